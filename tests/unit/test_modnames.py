"""Which module names a warm interpreter may import ahead of time
(worker/_modnames.py), and the typed report that carries them: a worker's
channel message or the job's note ``modules`` (agent/modcache.py)."""

from __future__ import annotations

import json

import pytest

from elastrun.agent.modcache import MAX_MODULES, installed_only, valid_names
from elastrun.rendezvous.notes import ModuleReport, NoteInvalid
from elastrun.untrusted import loads
from elastrun.worker._modnames import MAX_NAME, checked, refusal, script_module

ALLOWED = ["torch", "torch.optim", "os.path", "email.mime.text", "__future__", "_ssl", "a_b.c9"]


@pytest.mark.parametrize("name", ALLOWED)
def test_ordinary_modules_pass(name):
    assert refusal(name) is None


REFUSED = [
    # Not a dotted Python name.
    ("", "not a module name"),
    (None, "not a module name"),
    (["os"], "not a module name"),
    ("a" * (MAX_NAME + 1), "longer than"),
    ("../etc/passwd", "not a dotted"),
    ("os.", "not a dotted"),
    (".os", "not a dotted"),
    ("a b", "not a dotted"),
    ("9lives", "not a dotted"),
    ("módulo", "not a dotted"),  # ASCII identifiers only
    ("os\n", "not a dotted"),
    # A program's entry point: importing it runs the program.
    ("__main__", "entry point"),
    ("__mp_main__", "entry point"),
    ("unittest.__main__", "entry point"),
    ("pip.__main__", "entry point"),
    ("json.tool.__main__", "entry point"),
    ("a.__main__.b", "entry point"),
    # Dunder names: CPython's frozen modules that print when imported.
    ("__hello__", "dunder"),
    ("__phello__", "dunder"),
    ("__phello__.spam", "dunder"),
    # Modules that act when imported, or exist to open windows.
    ("this", "acts when imported"),
    ("antigravity", "acts when imported"),
    ("idlelib.idle", "acts when imported"),
    ("turtle", "acts when imported"),
    ("turtledemo", "acts when imported"),
    ("tkinter.ttk", "acts when imported"),
    ("test.autotest", "acts when imported"),
    # elastrun's own runner code, loaded by path.
    ("_elastrun_zygote", "elastrun's own"),
]


@pytest.mark.parametrize(("name", "why"), REFUSED, ids=[repr(n)[:30] for n, _ in REFUSED])
def test_names_that_are_refused_and_why(name, why):
    got = refusal(name)
    assert got is not None and why in got


def test_the_script_itself_is_never_imported():
    assert script_module("script", "train.py") == "train"
    assert script_module("script", "/jobs/run/train.py") == "train"
    assert script_module("script", "my-train.py") is None  # not importable by name
    assert script_module("script", "a.b.py") is None
    assert script_module("module", "pkg.train") == "pkg.train"
    assert refusal("train", "train") == "the script itself"
    assert refusal("pkg.train", "pkg.train") == "the script itself"
    assert refusal("pkg.train.helpers", "pkg.train") == "the script itself"
    assert refusal("pkg", "pkg.train") is None  # its package is imported by the run anyway
    assert refusal("trainer", "train") is None
    assert refusal("train", None) is None


def test_a_list_keeps_the_distinct_names_that_pass_within_bounds():
    names = ["os", "os", "this", {"x": 1}, ["y"], "unittest.__main__", "json", 7, "train"]
    assert checked(names, "train") == ["os", "json"]
    assert checked("os,json") == []  # only a list is a list of names
    assert checked({"os": 1}) == []
    assert len(checked([f"m{i}" for i in range(MAX_MODULES + 10)])) == MAX_MODULES
    assert valid_names(["this", "wave"]) == ["wave"]  # the cache's check is the same rule


def test_the_attackers_note_is_read_as_a_report_of_the_names_that_pass():
    note = {"v": 1, "modules": ["unittest.__main__", "this", "__hello__", "wave"], "python": "3"}
    report = ModuleReport.from_json(note)
    assert report == ModuleReport(modules=("wave",), python="3", torch=None, refused=3)
    # A worker's report names no module that would run the script again either.
    mine = ModuleReport.listed(["train", "train.util", "wave"], "3", None, script="train")
    assert mine == ModuleReport(modules=("wave",), python="3", refused=2)
    # What an agent writes for the others reads back as the same report.
    again = ModuleReport.from_json(json.loads(json.dumps(report.to_json())))
    assert again == ModuleReport(modules=("wave",), python="3")


@pytest.mark.parametrize(
    "data",
    [None, [], "modules", {"modules": "os"}, {"modules": {"os": 1}}, {"v": 1}, {"python": "3"}],
)
def test_what_is_not_a_module_list_is_no_report(data):
    with pytest.raises(NoteInvalid):
        ModuleReport.from_json(data)


def test_versions_are_short_plain_strings_or_nothing():
    def versions(python: object, torch: object) -> tuple[str | None, str | None]:
        report = ModuleReport.from_json({"modules": [], "python": python, "torch": torch})
        assert report is not None
        return report.python, report.torch

    assert versions("3.11.7", "2.13.0+cpu") == ("3.11.7", "2.13.0+cpu")
    assert versions("\x1b]0;pwned\x07", 2) == (None, None)
    assert versions("9" * 65, ["2"]) == (None, None)


def test_a_deeply_nested_note_is_refused_before_it_is_decoded():
    # The bound is the decoder's (read_note, the cache): the report never sees it.
    with pytest.raises(ValueError, match="nested more than"):
        loads("[" * 100_000, max_bytes=1 << 20)


def test_a_peers_names_must_resolve_to_installed_modules_here(tmp_path, monkeypatch):
    (tmp_path / "planted.py").write_text("open('PLANTED', 'w').close()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    got = installed_only(["json", "planted", "planted.sub", "no_such_module_xyz", "email.mime"])
    assert got == ["json", "email.mime"]
    assert not (tmp_path / "PLANTED").exists()  # looked up, never imported
