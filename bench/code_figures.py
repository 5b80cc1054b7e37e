"""Structure figures of a package (issue 18): modules, lines, docstring share, function-local imports, the 10 longest
functions, modules naming DeepSpeed/FSDP. Usage: python bench/code_figures.py REPO [PACKAGE ...]"""
import ast
import pathlib
import subprocess
import sys

root = pathlib.Path(sys.argv[1]); pkgs = sys.argv[2:] or ["finetune"]
files = [p for pkg in pkgs for p in sorted((root / pkg).rglob("*.py"))]
total = doc = 0; funcs = []; local = []
for p in files:
    text = p.read_text(); lines = text.splitlines(); total += len(lines)
    tree = ast.parse(text)
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if node.body and isinstance(node.body[0], ast.Expr) and isinstance(getattr(node.body[0], "value", None), ast.Constant) and isinstance(node.body[0].value.value, str):
                d = node.body[0]; doc += d.end_lineno - d.lineno + 1
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            funcs.append((node.end_lineno - node.lineno + 1, f"{p.relative_to(root)}:{node.lineno} {node.name}"))
            for sub in ast.walk(node):
                if isinstance(sub, (ast.Import, ast.ImportFrom)):
                    local.append(f"{p.relative_to(root)}:{sub.lineno}")
print(f"modules: {len(files)}, lines: {total}, docstring lines: {doc} ({100*doc/total:.1f}%)")
print(f"function-local imports: {len(local)}", sorted({l.split(':')[0] for l in local}))
print("10 longest functions:"); [print(f"  {n:4d} {w}") for n, w in sorted(funcs, reverse=True)[:10]]
out = subprocess.run(["git", "grep", "-liE", "deepspeed|fsdp|ds_numel|ds_shape", "--", *pkgs], cwd=root, capture_output=True, text=True).stdout.split()
print(f"modules naming DeepSpeed/FSDP: {len(out)}", out)
