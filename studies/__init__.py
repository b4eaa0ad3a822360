"""Studies of the product: each a project of its own (code, results, report, tests) that runs the
product's scripts as a user would."""
