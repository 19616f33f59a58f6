"""No replayed data: a healed group continues its shard exactly where its kept training left it.

Each rank logs (test hook) the hashes of the batches it drew, and whether their training
stood. Over a run with a kill, the batches a group kept never repeat, and they are exactly
the batches the same group keeps in a run without the fault, in the same order: the group
skips nothing and replays nothing, it only gets there later. The same holds when a rank
dies right after its group's commit, before the step's answer reached the controller.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import train

JOB = ("replicas=2", "steps=30", "seed=3")


def kept_batches(log_dir: Path) -> dict[str, list[str]]:
    """Per `replicaR-rankK`: the batches whose training stood, in the order they were drawn."""
    kept = {}
    for path in sorted(log_dir.glob("*.jsonl")):
        rows = []
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except ValueError:  # a killed process may leave half a line
                continue
        kept[path.stem] = [b for row in rows if row["kept"] for b in row["batches"]]
    return kept


def run_logging_batches(path: Path, *overrides: str, env: dict | None = None):
    log = path / "batches"
    log.mkdir(parents=True)
    run = train(path, *JOB, *overrides, env={"MONARCH_SKY_TEST_BATCH_LOG": str(log), **(env or {})})
    assert run.returncode == 0, run.output[-3000:]
    return run, kept_batches(log)


@pytest.fixture(scope="module")
def clean_batches(tmp_path_factory) -> dict[str, list[str]]:
    return run_logging_batches(tmp_path_factory.mktemp("clean"), "faults=none")[1]


def assert_neither_replayed_nor_skipped(seen: dict[str, list[str]], expected: dict[str, list[str]]) -> None:
    assert sorted(seen) == sorted(expected) == [f"replica{r}-rank{k}" for r in (0, 1) for k in (0, 1)]
    for name, batches in seen.items():
        assert len(batches) == len(set(batches)), f"{name} trained on a batch twice"
        assert batches == expected[name][: len(batches)], f"{name} skipped or reordered data"
        assert len(batches) > 10, f"{name} kept too little to show anything"


def test_a_healed_group_neither_replays_nor_skips_data(tmp_path, clean_batches):
    faulty, seen = run_logging_batches(tmp_path, "faults=kill@10:1")
    [fault] = faulty.summary["faults"]
    assert fault["recovered_from"] == "peer"
    assert_neither_replayed_nor_skipped(seen, clean_batches)


def test_a_group_that_died_after_its_commit_does_not_train_that_steps_batches_again(tmp_path, clean_batches):
    # Replica 1's rank 0 dies right after its group committed step 10, before the answer
    # leaves: the others' step-10 commit counted replica 1, so its batches were trained.
    run, seen = run_logging_batches(tmp_path, "faults=none", env={"MONARCH_SKY_TEST_DIE_AFTER_COMMIT": "1:10"})
    [failure] = run.summary["unplanned_failures"]
    assert failure["replica"] == 1 and failure["step"] == 9, failure  # its last answer was step 9
    assert [(e["replica"], e["step"]) for e in run.events if e["event"] == "trained_unreported"] == [(1, 10)]
    rejoined = [e for e in run.events if e["event"] == "replica_rejoined"]
    assert [(e["replica"], e["recovered_from"]) for e in rejoined] == [(1, "peer")]
    assert_neither_replayed_nor_skipped(seen, clean_batches)


DILOCO = ("ft.mode=diloco", "ft.sync_steps=5")


@pytest.fixture(scope="module")
def clean_diloco_batches(tmp_path_factory) -> dict[str, list[str]]:
    return run_logging_batches(tmp_path_factory.mktemp("clean-diloco"), *DILOCO, "faults=none")[1]


def test_a_diloco_group_that_died_after_its_sync_does_not_train_that_intervals_batches_again(
        tmp_path, clean_diloco_batches):
    # DiLoCo keeps a group's data position at its syncs. Replica 1 dies right after the sync
    # at step 10 committed: its pseudo-gradient of steps 6-10 is in everyone's weights.
    run, seen = run_logging_batches(tmp_path, *DILOCO, "faults=none",
                                    env={"MONARCH_SKY_TEST_DIE_AFTER_COMMIT": "1:10"})
    [failure] = run.summary["unplanned_failures"]
    assert failure["replica"] == 1 and failure["step"] == 9, failure
    assert [(e["replica"], e["step"]) for e in run.events if e["event"] == "trained_unreported"] == [(1, 10)]
    rejoined = [e for e in run.events if e["event"] == "replica_rejoined"]
    assert [(e["replica"], e["recovered_from"], e["heal_transport"]) for e in rejoined] == [(1, "peer", "tcp")]
    assert_neither_replayed_nor_skipped(seen, clean_diloco_batches)
    # Syncs after the heal moved both groups' weights through their own outer optimizers: equal
    # weights at the end mean the outer momentum (a DTensor) crossed the heal intact.
    assert len(set(run.summary["final_param_digest"].values())) == 1, run.summary["final_param_digest"]
