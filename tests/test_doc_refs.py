"""Every file and oneiter module that a docstring, a comment or a doc names exists (tools/check_refs.py)."""

from __future__ import annotations

from pathlib import Path

from conftest import load_tool

ROOT = Path(__file__).resolve().parent.parent
check_refs = load_tool("check_refs")


def test_every_named_file_and_module_exists():
    problems = [p for source in check_refs.sources() for p in check_refs.check_text(check_refs.prose(source), source)]
    assert problems == []


def test_the_check_flags_a_missing_page_a_missing_module_and_a_missing_name():
    source = ROOT / "oneiter" / "judge" / "iteration" / "engine.py"
    text = ("See docs/nowhere.md and `format.nowhere`, ../shared/NOTES.md.\n"
            "`judge.iteration.verdict.no_such_function` and [a link](docs/gone.md#x)\n"
            "Fine: docs/blame.md, `judge.iteration.verdict.decide`, `oneiter.format.stats`, `torch.cuda`, "
            "my_model.py\n")
    problems = check_refs.check_text(text, source)
    assert [p.split(": ", 1)[1] for p in problems] == [
        "'docs/nowhere.md': no such file",
        "'../shared/NOTES.md': no such file",
        "'format.nowhere': no such module or name in oneiter",
        "'docs/gone.md': no such file",
        "'judge.iteration.verdict.no_such_function': no such module or name in oneiter",
    ]


def test_only_docstrings_and_comments_of_python_files_are_prose(tmp_path):
    module = tmp_path / "m.py"
    module.write_text('"""Module docs name docs/a.md."""\nX = "t.toml"  # a comment names docs/b.md\n'
                      '"""A constant\'s docstring names docs/c.md."""\n')
    assert check_refs.prose(module).split("\n")[:3] == [
        " Module docs name docs/a.md.", " # a comment names docs/b.md", " A constant's docstring names docs/c.md."]


def test_an_attribute_set_in_a_method_is_a_name_of_its_class():
    assert check_refs.module_exists("format.stats.Stats.values")
    assert not check_refs.module_exists("format.stats.Stats.no_such_attribute")
