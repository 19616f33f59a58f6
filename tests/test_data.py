"""No replayed data: a healed group continues its shard exactly where its kept training left it.

Each rank logs (test hook) the hashes of the batches it drew, and whether their training
stood. Over a run with a kill, the batches a group kept never repeat, and they are exactly
the batches the same group keeps in a run without the fault, in the same order: the group
skips nothing and replays nothing, it only gets there later.
"""

from __future__ import annotations

import json
from pathlib import Path

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


def test_a_healed_group_neither_replays_nor_skips_data(tmp_path):
    logs = {name: tmp_path / f"batches-{name}" for name in ("clean", "kill")}
    for log in logs.values():
        log.mkdir()
    clean = train(tmp_path / "clean", *JOB, "faults=none", env={"MONARCH_SKY_TEST_BATCH_LOG": str(logs["clean"])})
    assert clean.returncode == 0, clean.output[-3000:]
    faulty = train(tmp_path / "kill", *JOB, "faults=kill@10:1", env={"MONARCH_SKY_TEST_BATCH_LOG": str(logs["kill"])})
    assert faulty.returncode == 0, faulty.output[-3000:]
    [fault] = faulty.summary["faults"]
    assert fault["recovered_from"] == "peer"

    expected, seen = kept_batches(logs["clean"]), kept_batches(logs["kill"])
    assert sorted(seen) == sorted(expected) == [f"replica{r}-rank{k}" for r in (0, 1) for k in (0, 1)]
    for name, batches in seen.items():
        assert len(batches) == len(set(batches)), f"{name} trained on a batch twice"
        assert batches == expected[name][: len(batches)], f"{name} skipped or reordered data"
        assert len(batches) > 10, f"{name} kept too little to show anything"
