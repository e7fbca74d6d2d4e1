"""A recording's settings are declared once, in `RecordOptions` (`record/options.py`): `oneiter.Recorder`'s
keywords, the framework integrations' keywords and the API docs' table follow it, so none of them can drift."""

from __future__ import annotations

import ast
import inspect
import re
from dataclasses import MISSING, fields
from pathlib import Path

import pytest
import torch

import oneiter
from oneiter.errors import OneIterError
from oneiter.format.writer import DEFAULT_QUEUE_BYTES
from oneiter.integrations import recording
from oneiter.integrations.step_driver import DrivenCallback, callback_options
from oneiter.record import options as options_module
from oneiter.record.options import RecordOptions, keyword_signature, options_from
from oneiter.record.recorder import Recorder

ROOT = Path(__file__).resolve().parents[2]
SETTINGS = {f.name for f in fields(RecordOptions)}
OWN = {"optimizer", "progress", "notify"}  # the Recorder's own keywords: live objects, not settings


def _default(f):
    return f.default if f.default is not MISSING else f.default_factory()


def _keywords(signature: inspect.Signature) -> dict:
    return {p.name: p.default for p in signature.parameters.values() if p.kind is p.KEYWORD_ONLY}


def test_every_setting_is_a_recorder_keyword_with_its_default_and_nothing_else():
    keywords = _keywords(inspect.signature(Recorder))
    assert set(keywords) == SETTINGS - {"out"} | OWN
    assert {name: keywords[name] for name in SETTINGS - {"out"}} == {
        f.name: _default(f) for f in fields(RecordOptions) if f.name != "out"}
    assert list(inspect.signature(Recorder).parameters)[:2] == ["model", "out"]


def test_the_signature_check_sees_a_setting_the_recorder_would_lack():
    """The derivation itself: a function that spells out a keyword keeps it, and every other setting is added."""
    def init(self, model, out, *, optimizer=None, seed=5, **options):
        pass

    keywords = _keywords(keyword_signature(init))
    assert keywords["seed"] == 5 and set(keywords) == SETTINGS - {"out"} | {"optimizer"}


def _field_docs() -> dict[str, str]:
    """Each field of `RecordOptions` and the string that follows it in options.py (its documentation), or ""."""
    tree = ast.parse(Path(options_module.__file__).read_text(encoding="utf-8"))
    body = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "RecordOptions").body
    docs = {}
    for node, after in zip(body, [*body[1:], None], strict=True):
        if isinstance(node, ast.AnnAssign):
            doc = after.value.value if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) else ""
            docs[node.target.id] = str(doc).strip()
    return docs


def test_every_setting_is_documented_where_it_is_declared():
    docs = _field_docs()
    assert set(docs) == SETTINGS
    assert not [name for name, doc in docs.items() if len(doc) < 20], "a RecordOptions field without its docstring"


def _documented_args(doc: str) -> set[str]:
    """The names the `Args:` section of a docstring documents (`name:`, `a / b:`, `**name:`)."""
    section = doc.split("Args:", 1)[1].split("\n\n", 1)[0]
    names = set()
    for line in section.splitlines():
        match = re.match(r"^ {8}([\w*][\w*, /]*):", line)
        if match:
            names |= {n.strip().lstrip("*") for n in re.split(r"[,/]", match.group(1))}
    return names


def test_the_recorder_documents_its_own_arguments_and_sends_the_settings_to_record_options():
    documented = _documented_args(Recorder.__doc__)
    assert documented == {"model", "out"} | OWN | {"options"}
    assert "RecordOptions" in Recorder.__doc__.split("**options:", 1)[1]


@pytest.fixture(scope="module")
def model():
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))


def test_recorder_keywords_become_its_options(model, tmp_path):
    given = {"amp": "bfloat16", "include": "0", "seed": None, "isolate": False, "calibrate": "device",
             "random_replay": False, "force": True, "name": "tiny", "meta": {"k": 1}, "skip": ["2"],
             "queue_bytes": 1 << 20, "level": "stats", "compile": True, "compile_modules": "0"}
    rec = oneiter.Recorder(model, tmp_path / "a.h5", **given)
    assert rec.options == RecordOptions(out=tmp_path / "a.h5", **given)
    assert (rec.options.amp, rec.options.compile, rec.options.skip) == ("bf16", "inductor", ("2",))
    assert oneiter.Recorder(model, tmp_path / "b.h5", queue_bytes=None).options.queue_bytes == DEFAULT_QUEUE_BYTES


def test_an_unknown_recorder_keyword_is_refused_as_python_refuses_one(model, tmp_path):
    with pytest.raises(TypeError, match=r"^Recorder\(\) got an unexpected keyword argument 'seeds'$"):
        oneiter.Recorder(model, tmp_path / "a.h5", seeds=1)
    with pytest.raises(TypeError, match="unexpected keyword argument 'out'"):
        options_from("Recorder", tmp_path / "a.h5", {"out": tmp_path / "b.h5"})
    with pytest.raises(OneIterError, match="^impact_from names the calls to fix at every step"):
        with oneiter.Recorder(model, tmp_path / "a.h5", impact=True, replay=tmp_path / "r.h5",
                              impact_from=tmp_path / "r1.h5"):
            pass


def test_the_integrations_take_every_setting_but_the_frameworks_own(tmp_path):
    """The Trainer and Lightning callbacks (`DrivenCallback`) and the mmengine hook build their options from the
    same keywords (`integrations/recording.py`): every setting but autocast's, which the framework decides."""
    assert recording.KEYWORDS == SETTINGS - set(recording.FRAMEWORK_OWNED) | {"model_name"}
    assert set(recording.FRAMEWORK_OWNED) <= SETTINGS
    every = {f.name: _default(f) for f in fields(RecordOptions) if f.name in recording.KEYWORDS - {"out"}}
    every["out"] = tmp_path / "a.h5"
    built = callback_options("OneIterCallback", step=0, every=None, options=None, keywords=every)
    assert built == RecordOptions(**{**every, "manage_autocast": False})
    with pytest.raises(OneIterError, match="amp is the training framework's own"):
        callback_options("OneIterCallback", step=0, every=None, options=None,
                         keywords={"out": tmp_path / "a.h5", "amp": "bf16"})
    mmengine = pytest.importorskip("oneiter.integrations.mmengine")
    hook = mmengine.OneIterRecordHook(iteration=0, **every)
    assert hook.options == RecordOptions(**{**every, "manage_autocast": False, "skip": hook.options.skip})
    assert hook.options.skip == ("data_preprocessor",)


def _backquoted(text: str) -> set[str]:
    return set(re.findall(r"`([a-z_]+)`", text))


def test_the_integrations_document_only_keywords_they_take():
    """What their docstrings list as the recording's keywords exists (a renamed setting fails here)."""
    mmengine = pytest.importorskip("oneiter.integrations.mmengine")
    hook_args = _documented_args(mmengine.OneIterRecordHook.__doc__)
    assert hook_args - {"iteration", "every", "options"} <= recording.KEYWORDS
    assert {"out", "replay", "include", "exclude", "seed", "model_name", "isolate", "force"} <= hook_args
    record = DrivenCallback.__doc__.split("**record:", 1)[1].split("\n\n", 1)[0]
    # `amp`: named as what it does not take; `model`: the file's attribute `model_name` sets
    assert _backquoted(record) - {"amp", "model"} <= recording.KEYWORDS
    assert "model_name" in _backquoted(record) and "out" in _backquoted(record)
    checked = re.findall(r'record\.get\("(\w+)"\)', inspect.getsource(mmengine._check_types))
    assert checked and set(checked) <= recording.KEYWORDS


def test_the_api_docs_table_lists_every_setting():
    """docs/api.md's table of the Recorder's parameters: a row for each setting and each own keyword, and no row
    for what neither the Recorder nor the StepRecorder takes."""
    text = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    table = text.split("Parameters (all keyword-only after `model` and `out`):", 1)[1].split("\n\n", 2)[1]
    rows = {name for line in table.splitlines() if line.startswith("| `")
            for name in re.findall(r"`(\w+)`", line.split("|")[1])}
    wanted = SETTINGS - {"out"} | OWN
    assert wanted <= rows, f"not in docs/api.md's table: {sorted(wanted - rows)}"
    step_keywords = set(inspect.signature(oneiter.StepRecorder).parameters)
    assert rows <= SETTINGS | OWN | step_keywords
