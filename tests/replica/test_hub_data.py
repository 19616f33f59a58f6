"""A cloud run's tokenizer and data, in the hub's own on-disk formats, made here.

- The tokenizer comes from a (loopback) hub through the real `huggingface_hub` client:
  a gated repository without a token, or with a token that has no access, stops with one
  error naming HF_TOKEN and the fix; with access only the tokenizer's files arrive, and a
  job naming `data.tokenizer_repo` validates only once they are there.
- C4 (json.gz shards) and FineWeb-Edu (parquet shards) snapshots, laid out as their hub
  repositories are, load through TorchTitan's own dataset loaders and tokenize to the text
  in the shards.
- A run trains on the C4 snapshot with the fetched tokenizer, loses a group and heals it,
  and the healed group draws no batch twice (streaming data resumes where it left off).
"""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, cli_env, train
from fake_hub import FakeHub, tokenizer_files
from test_data import kept_batches

from monarch_sky.common import test_hooks

REPO_ID = "meta-llama/Llama-3.1-8B"
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"


def docs(shard: int, n: int = 40) -> list[str]:
    return [f"Shard {shard} story {i}: the fox ran to the river and the bird sang a song." for i in range(n)]


def make_tokenizer(folder: Path) -> Path:
    """A byte-level BPE with Llama 3's special tokens, saved as a hub model repo holds it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=[BOS, EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(docs(0) + docs(1), trainer=trainer)
    folder.mkdir(parents=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": BOS, "eos_token": EOS}))
    return folder


def readme(config: str, splits: dict[str, str]) -> str:
    files = "".join(f"  - split: {split}\n    path: \"{glob}\"\n" for split, glob in splits.items())
    return f"---\nconfigs:\n- config_name: {config}\n  data_files:\n{files}---\n"


def make_c4(folder: Path) -> Path:
    """allenai/c4's layout: en/c4-{split}.NNNNN-of-NNNNN.json.gz, configs in README.md."""
    (folder / "en").mkdir(parents=True)
    for shard in range(2):
        with gzip.open(folder / "en" / f"c4-train.{shard:05d}-of-00002.json.gz", "wt") as f:
            for text in docs(shard):
                f.write(json.dumps({"text": text, "timestamp": "2019-04-25T12:57:54Z", "url": "https://x"}) + "\n")
    with gzip.open(folder / "en" / "c4-validation.00000-of-00001.json.gz", "wt") as f:
        f.write(json.dumps({"text": "held out", "timestamp": "", "url": ""}) + "\n")
    splits = {"train": "en/c4-train.*.json.gz", "validation": "en/c4-validation.*.json.gz"}
    (folder / "README.md").write_text(readme("en", splits))
    return folder


def make_fineweb_edu(folder: Path) -> Path:
    """HuggingFaceFW/fineweb-edu's layout: sample/10BT/NNN_NNNNN.parquet, config sample-10BT."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    (folder / "sample" / "10BT").mkdir(parents=True)
    for shard in range(2):
        texts = docs(shard)
        table = pa.table({"text": texts, "id": [f"<urn:{shard}:{i}>" for i in range(len(texts))], "score": [3.1] * len(texts)})
        pq.write_table(table, folder / "sample" / "10BT" / f"{shard:03d}_00000.parquet")
    (folder / "README.md").write_text(readme("sample-10BT", {"train": "sample/10BT/*"}))
    return folder


@pytest.fixture
def tokenizer(tmp_path) -> Path:
    return make_tokenizer(tmp_path / "tokenizer")


def fetch(hub: FakeHub, cache: Path, token: str | None) -> subprocess.CompletedProcess:
    env = {**cli_env(), "HF_ENDPOINT": hub.endpoint, "MONARCH_SKY_CACHE": str(cache), "HF_HUB_DISABLE_XET": "1"}
    env.pop("HF_TOKEN", None)
    env.update({"HF_TOKEN": token} if token else {})
    return subprocess.run([sys.executable, "-m", "monarch_sky", "fetch-tokenizer", REPO_ID], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)


def test_a_gated_tokenizer_needs_a_token_with_access_and_only_its_files_arrive(tmp_path, tokenizer, monkeypatch):
    from monarch_sky.config import load_job

    hub, cache = FakeHub(REPO_ID, tokenizer_files(tokenizer), token="hf_granted", gated=True), tmp_path / "cache"
    job = ("recipe=llama3_tiny", "data.tokenizer_path=null", f"data.tokenizer_repo={REPO_ID}")
    monkeypatch.setenv("MONARCH_SKY_CACHE", str(cache))
    try:
        for token, who in ((None, "no HF_TOKEN was given"), ("hf_other", "the HF_TOKEN given has no access")):
            refused = fetch(hub, cache, token)
            assert refused.returncode == 2
            assert f"HF_TOKEN: {REPO_ID} is gated and {who}; fix: accept its license" in refused.stderr
            assert "hf_other" not in refused.stdout + refused.stderr  # the token is never printed
        assert load_job(list(job)), "a preview (`config`) needs no tokenizer yet"
        refused = subprocess.run([sys.executable, "-m", "monarch_sky", "train", *job], cwd=REPO, capture_output=True,
                                 text=True, timeout=120, env={**os.environ, "MONARCH_SKY_CACHE": str(cache)})
        assert refused.returncode == 2 and "data.tokenizer_repo: " in refused.stderr, refused.stderr
        assert "monarch-sky fetch-tokenizer" in refused.stderr
        fetched = fetch(hub, cache, "hf_granted")
        assert fetched.returncode == 0, fetched.stderr
    finally:
        hub.close()
    folder = cache / "tokenizers" / REPO_ID
    assert sorted(p.name for p in folder.iterdir() if p.is_file()) == ["tokenizer.json", "tokenizer_config.json"]
    assert load_job(list(job)).config.data.tokenizer_repo == REPO_ID  # validates now


@pytest.mark.parametrize("dataset,make", [("c4", make_c4), ("fineweb_edu", make_fineweb_edu)])
def test_hub_format_shards_load_through_torchtitans_loaders(tmp_path, tokenizer, dataset, make):
    from torchtitan.components.tokenizer import HuggingFaceTokenizer
    from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataset

    from monarch_sky.replica.trainer import import_torchtitan

    import_torchtitan()  # registers fineweb_edu
    snapshot = make(tmp_path / dataset)
    tok = HuggingFaceTokenizer(tokenizer_path=str(tokenizer))
    texts = []
    for rank in range(2):
        data = HuggingFaceTextDataset(dataset, str(snapshot), tok, seq_len=64, dp_rank=rank, dp_world_size=2)
        inputs, _labels = next(iter(data))
        texts.append(tok.decode(inputs["input"].tolist() if isinstance(inputs, dict) else inputs.tolist()))
    assert "Shard 0 story 0: the fox ran to the river" in texts[0]
    assert texts[0] != texts[1]  # the two data-parallel ranks read different documents


@pytest.mark.parametrize("kind", ["jsonl", "txt", "folder"])
def test_your_own_text_loads_as_local_text(tmp_path, tokenizer, kind):
    # data.dataset=local_text data.dataset_path=FILE_OR_FOLDER: a .jsonl ({"text": ...} a line),
    # a .txt (a record a line) or a folder of them, through TorchTitan's own text dataset.
    from torchtitan.components.tokenizer import HuggingFaceTokenizer
    from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataset

    from monarch_sky.config import load_job
    from monarch_sky.replica.trainer import import_torchtitan

    import_torchtitan()  # registers local_text
    folder = tmp_path / "mine"
    folder.mkdir()
    if kind == "txt":
        (folder / "part.txt").write_text("\n".join(docs(0)) + "\n")
    else:
        (folder / "part.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs(0)))
    path = folder if kind == "folder" else next(folder.iterdir())
    job = load_job(["recipe=llama3_tiny", f"data.tokenizer_path={tokenizer}", "data.dataset=local_text",
                    f"data.dataset_path={path}"])
    assert job.config.data.dataset == "local_text"
    tok = HuggingFaceTokenizer(tokenizer_path=str(tokenizer))
    data = HuggingFaceTextDataset("local_text", str(path), tok, seq_len=64)
    inputs, _labels = next(iter(data))
    assert "Shard 0 story 0: the fox ran to the river" in tok.decode(
        inputs["input"].tolist() if isinstance(inputs, dict) else inputs.tolist())


def test_a_run_on_hub_format_data_heals_and_replays_no_batch(tmp_path, tokenizer):
    snapshot, log = make_c4(tmp_path / "c4"), tmp_path / "batches"
    log.mkdir()
    run = train(tmp_path / "run", "replicas=2", "procs_per_replica=1", "steps=16", "faults=kill@6:1",
                f"data.tokenizer_path={tokenizer}", "data.dataset=c4", f"data.dataset_path={snapshot}",
                env={"MONARCH_SKY_TEST_BATCH_LOG": str(log), "HF_ENDPOINT": "http://127.0.0.1:9",
                     test_hooks.STEP_PAUSE_ENV: "0.25"})  # the run outlasts a recovery whose standby still warms
    assert run.returncode == 0, run.output[-3000:]
    [fault] = run.summary["faults"]
    assert fault["recovered_from"] == "peer"
    assert run.summary["committed_steps"] == 16
    assert len(set(run.summary["final_param_digest"].values())) == 1
    kept = kept_batches(log)
    assert sorted(kept) == ["replica0-rank0", "replica1-rank0"]
    for name, batches in kept.items():
        assert len(batches) == len(set(batches)), f"{name} trained on a batch twice"
