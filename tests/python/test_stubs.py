"""The type stubs (mxddp/_C.pyi) declare exactly what the extension module has."""
import ast
import inspect
from pathlib import Path

import mxddp
from mxddp import _C


def stub_names():
    tree = ast.parse((Path(mxddp.__file__).parent / "_C.pyi").read_text())
    top, members = set(), {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            top.add(node.name)
        if isinstance(node, ast.ClassDef):
            members[node.name] = {n.name if not isinstance(n, ast.AnnAssign) else n.target.id
                                  for n in node.body if isinstance(n, (ast.FunctionDef, ast.AnnAssign))}
    return top, members


def module_names():
    top, members = set(), {}
    for name, obj in vars(_C).items():
        if name.startswith("_"):
            continue
        top.add(name)
        if inspect.isclass(obj) and name != "Error":
            members[name] = {n for n in vars(obj) if not n.startswith("_")} | {"__init__"}
    return top, members


def test_stubs_match_the_module():
    stub_top, stub_members = stub_names()
    mod_top, mod_members = module_names()
    assert stub_top == mod_top
    for cls, names in mod_members.items():
        assert stub_members[cls] == names, cls
