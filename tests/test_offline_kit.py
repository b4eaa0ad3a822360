"""benchmarks/offline_kit.py: which packages travel to a GPU node without internet (the parts
that need no network)."""

from __future__ import annotations

import importlib.util
import zipfile

from conftest import ROOT

spec = importlib.util.spec_from_file_location("offline_kit", ROOT / "benchmarks" / "offline_kit.py")
kit = importlib.util.module_from_spec(spec)
spec.loader.exec_module(kit)


def test_present_names_read_pip_freeze_or_plain_lists():
    freeze = "absl-py==2.1.0\nPyYAML==6.0.2\ntyping_extensions @ file:///wheels/te.whl\n# pinned\n"
    assert kit.present_names(freeze) == {"absl-py", "pyyaml", "typing-extensions"}
    assert kit.present_names("numpy\nTorch\n\nsafetensors\n") == {"numpy", "torch", "safetensors"}
    assert kit.present_names("zipp, numpy>=1.26, -e .\n") == {"zipp", "numpy"}


def test_needs_follow_the_nodes_markers():
    got = kit.needs([
        "Braceexpand",
        "tomli; python_version < '3.11'",  # the target runs 3.12
        "pywin32; sys_platform == 'win32'",
        "uvloop; sys_platform == 'linux'",
        "pytest; extra == 'test'",  # extras are never asked for
        "typing_extensions>=4.6; python_version < '3.13'",
    ])  # fmt: skip
    assert got == ["braceexpand", "uvloop", "typing-extensions"]


def test_closure_is_transitive_and_stops_at_what_the_machine_has():
    graph = {"mlflow-skinny": ["sqlparse", "numpy", "gitpython"], "gitpython": ["gitdb"],
             "gitdb": ["smmap", "gitpython"], "webdataset": ["braceexpand", "numpy"]}  # fmt: skip
    seen = []

    def requires(name):
        seen.append(name)
        return graph.get(name, [])

    got = kit.closure(["mlflow_skinny", "webdataset"], {"numpy"}, requires)
    assert sorted(got) == ["braceexpand", "gitdb", "gitpython", "mlflow-skinny", "smmap",
                           "sqlparse", "webdataset"]  # fmt: skip
    assert len(seen) == len(set(seen)) == len(got)  # each wheel read once, the cycle ends


def test_wheel_requires_reads_requires_dist(tmp_path):
    wheel = tmp_path / "demo-1.0-py3-none-any.whl"
    head = "Name: demo\nRequires-Dist: hjson\nRequires-Dist: x; extra == 'y'\n"
    body = "\nRequires-Dist: in the description, not a header\n"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("demo-1.0.dist-info/METADATA", head + body)
    assert kit.wheel_requires(wheel) == ["hjson", "x; extra == 'y'"]
    assert kit.wheel_of("demo", tmp_path) == wheel and kit.wheel_of("other", tmp_path) is None
