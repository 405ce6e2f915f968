"""The return values of launch()'s functions (worker/_fn_results.py) and the launcher's copy of
the root cause's error file (launcher/error_file.py): pure parts, real files."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from elastrun.failure import FailureRecord
from elastrun.launcher.error_file import copied_error, pass_error_file
from elastrun.worker._fn_results import read_results, tensor_tree_problem, write_result


def test_a_tree_of_tensors_is_accepted_and_anything_else_named() -> None:
    tree = {"m": {"w": torch.ones(2), 3: [torch.zeros(1), (1, 2.5), None, "x", True]}}
    assert tensor_tree_problem(tree, torch.Tensor) is None
    assert "builtins.set" in (tensor_tree_problem({"a": {1}}, torch.Tensor) or "")
    assert "dict key of type tuple" in (tensor_tree_problem({(1, 2): 1}, torch.Tensor) or "")
    deep: object = torch.ones(1)
    for _ in range(100):
        deep = [deep]
    assert "levels deep" in (tensor_tree_problem(deep, torch.Tensor) or "")


def test_results_round_trip_as_json_or_tensors(tmp_path: Path) -> None:
    assert write_result(str(tmp_path), "0", 4, {"loss": 0.5}) is None
    assert write_result(str(tmp_path), "1", 5, {"w": torch.arange(3)}) is None
    assert sorted(os.listdir(tmp_path)) == ["local_0.json", "local_1.pt"]
    got = read_results(str(tmp_path))
    assert got[4] == {"loss": 0.5}
    assert torch.equal(got[5]["w"], torch.arange(3))


def test_an_object_is_refused_before_a_file_is_written(tmp_path: Path) -> None:
    problem = write_result(str(tmp_path), "0", 0, {"w": torch.ones(1), "f": os.path.join})
    assert problem and "neither JSON data nor a tree of tensors" in problem
    assert os.listdir(tmp_path) == []


def test_the_copy_sets_the_error_code_as_torch_does() -> None:
    raw = json.dumps({"message": {"message": "ValueError: x", "extraInfo": {}}}).encode()
    assert json.loads(copied_error(raw, 1) or b"")["message"]["errorCode"] == 1
    old = json.dumps({"message": "plain", "timestamp": 1}).encode()  # older format: kept
    assert json.loads(copied_error(old, 1) or b"") == {"message": "plain", "timestamp": 1}
    assert copied_error(b"not json", 1) is None


def test_pass_error_file_writes_only_what_there_is(tmp_path: Path) -> None:
    src = tmp_path / "error.json"
    src.write_text(json.dumps({"message": {"message": "boom", "extraInfo": {}}}))
    dest = tmp_path / "parent.json"
    dest.write_text("old")  # replaced, as torch does
    failure = FailureRecord(exitcode=3, error_file=str(src))
    assert pass_error_file(failure, str(dest)) == str(dest)
    assert json.loads(dest.read_text())["message"]["errorCode"] == 3
    assert pass_error_file(FailureRecord(signal="SIGKILL"), str(dest)) is None  # no file
    missing = FailureRecord(exitcode=1, error_file=str(tmp_path / "none.json"))
    assert pass_error_file(missing, str(tmp_path / "other.json")) is None
    assert not (tmp_path / "other.json").exists()
    link = tmp_path / "link.json"
    link.symlink_to(src)  # a worker's planted link is not followed
    assert pass_error_file(FailureRecord(exitcode=1, error_file=str(link)), str(dest)) is None
