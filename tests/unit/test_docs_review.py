"""Claims of README.md, docs/architecture.md and docs/operations.md that the code can check cheaply: the layer table
and the modules allowed imports inside functions (against tools/house_check.py and tests/unit/test_layers.py), each
"imports only ..." of a folder (against the imports the package makes), the command-line options the docs name
(against the options the project's CLIs and scripts define) and the one-machine launch of configs/quickstart.yaml
(which names no data of its own)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))
import house_check  # noqa: E402

sys.path.pop(0)

ARCH = (REPO / "docs" / "architecture.md").read_text(encoding="utf-8")
DOCS = {name: (REPO / name).read_text(encoding="utf-8")
        for name in ("README.md", "docs/architecture.md", "docs/operations.md")}

NUMBERS = {"one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7, "eight": 8}


def _top(name: str) -> str:
    """`config/`, `console.py`, `model/kernels.py`, `distributed` -> the top-level name under pretrain/."""
    name = name.strip().removeprefix("pretrain/").removeprefix("pretrain.")
    return re.split(r"[/.:]", name)[0]


def test_layer_table_is_house_checks():
    rows = re.findall(r"^\| (\d+) \| (.+) \|$", ARCH.split("## Layers", 1)[1].split("\n## ", 1)[0], re.M)
    documented = {_top(n): int(layer) for layer, names in rows for n in re.findall(r"`([^`]+)`", names)}
    assert documented == house_check.LAYERS


def test_modules_allowed_imports_inside_functions_are_test_layers_lazy():
    import ast

    source = (REPO / "tests" / "unit" / "test_layers.py").read_text(encoding="utf-8")
    lazy = ast.literal_eval(re.search(r"^LAZY = (\{.*?\})$", source, re.M).group(1))
    m = re.search(r"(\w+) modules are allowed imports inside functions(.*?)\n- ", ARCH, re.S)
    assert m, "architecture.md no longer says which modules may import inside functions"
    assert NUMBERS.get(m.group(1).lower()) == len(lazy), f"{m.group(1)} modules documented, LAZY has {len(lazy)}"
    text = m.group(2)
    for module in lazy:
        path = module.removeprefix("pretrain.").replace(".", "/") + ".py"
        assert path in text, f"{module} may import inside functions (LAZY) but architecture.md does not name it"


def _package_imports() -> dict[str, set[str]]:
    def top(module: str) -> str:
        parts = module.split(".")
        return parts[1] if len(parts) > 1 else parts[0]

    deps: dict[str, set[str]] = {}
    for name, path in house_check.modules().items():
        for target, _lazy, _line in house_check.project_imports(path):
            if top(target) != top(name):
                deps.setdefault(top(name), set()).add(top(target))
    return deps


def _imports_only_claims() -> dict[str, set[str]]:
    """{package: the names its paragraph under "What each folder may hold" says it imports only}."""
    section = ARCH.split("## What each folder may hold", 1)[1].split("\n## ", 1)[0]
    claims = {}
    for para in section.split("\n\n"):
        head = re.match(r"\*\*`pretrain/([\w]+)(?:/|\.py)`\*\*", para)
        only = re.search(r"imports?\s+only\s+(.*?)(?:\.(?:\s|$)|;)", para, re.S)
        if head and only:
            named = re.sub(r"\([^)]*\)", "", only.group(1))  # what a parenthesis adds is not a package named
            claims[head.group(1)] = {_top(n) for n in re.findall(r"`([^`]+)`", named)}
    return claims


def test_what_each_folder_imports_only():
    claims, actual = _imports_only_claims(), _package_imports()
    assert {"distributed", "data", "model", "metrics", "losses", "checkpoint"} <= set(claims), claims
    wrong = {pkg: (sorted(said), sorted(actual.get(pkg, set()))) for pkg, said in claims.items()
             if said != actual.get(pkg, set())}
    assert wrong == {}, f"architecture.md's 'imports only' (documented, actual): {wrong}"


OTHER_PROGRAMS = {  # options of sbatch/srun/scancel, torchrun, tensorboard and docker the docs mention
    "--nodes", "--gpus-per-node", "--cpus-per-task", "--gpus-per-task", "--exclude", "--full", "--batch",
    "--signal", "--requeue", "--wait", "--kill-on-bad-exit", "--nproc-per-node", "--logdir", "--shm-size", "--help",
}


def _defined_options() -> set[str]:
    found: set[str] = set()
    files = [*(REPO / "pretrain").rglob("*.py"), *(REPO / "tools").iterdir(), *(REPO / "slurm").iterdir()]
    for f in files:
        if f.is_file() and f.suffix in (".py", ".sh", ".sbatch"):
            found |= set(re.findall(r"""["'](--[a-z][a-z0-9-]*)["'=\s]""", f.read_text(encoding="utf-8")))
            if f.suffix in (".sh", ".sbatch"):
                found |= set(re.findall(r"(--[a-z][a-z0-9-]*)\)", f.read_text(encoding="utf-8")))  # case patterns
    return found


@pytest.mark.parametrize("doc", sorted(DOCS))
def test_every_option_the_docs_name_exists(doc):
    named = set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", DOCS[doc]))
    unknown = sorted(named - _defined_options() - OTHER_PROGRAMS)
    assert unknown == [], f"{doc} names options no CLI, tool or script of the project defines: {unknown}"


def test_quickstart_config_is_never_launched_without_its_data():
    """configs/quickstart.yaml leaves data.tokenizer and data.sources to the quickstart: a launch of it as it is
    stops with exit 2, so a documented launch must add the data (include=RUN_DIR/data.yaml or data.* keys)."""
    import yaml

    data = yaml.safe_load((REPO / "configs" / "quickstart.yaml").read_text(encoding="utf-8")).get("data", {})
    assert not data.get("tokenizer") and not data.get("sources")
    for doc, text in DOCS.items():
        for m in re.finditer(r"(?:pretrain-train|pretrain\.train) configs/quickstart\.yaml([^`\n]*)", text):
            rest = m.group(1)
            assert "include=" in rest or "data.tokenizer=" in rest, f"{doc}: `{m.group(0)}` names no data"
