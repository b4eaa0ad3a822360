"""Evaluators on frozen features: few-shot ridge (`fewshot`), linear probe (`linear_probe`),
results reporting (`report`); kNN lives in ssl_vit.knn. Import each from its module: the entry
scripts import `ssl_vit.evaluation.options` and `.cli` to parse their arguments, which must not
load torch and FAISS on the way.
"""
