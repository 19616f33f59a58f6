"""A cloud run's tokenizer and training text, from the Hugging Face Hub.

The local default trains offline on the shipped assets. A cloud recipe names the hub
repository its tokenizer comes from (`data.tokenizer_repo`); `sky/setup.sh` fetches it once
per node (`monarch-sky fetch-tokenizer`) with the HF_TOKEN secret into `tokenizer_dir(repo)`,
and training streams its text from the hub through TorchTitan's dataset loaders ("c4", and
"fineweb_edu", registered here the way TorchTitan's docs/datasets.md says to add one). The
hub is forced offline only when the data is a local folder.
"""

from __future__ import annotations

import os
from functools import partial
from pathlib import Path

TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "config.json"]
# Your own text (a file or folder of jsonl, json, parquet or txt), TorchTitan's own datasets, and
# FineWeb-Edu (the two that `register_datasets` adds).
LOCAL_TEXT = "local_text"
DATASETS = (LOCAL_TEXT, "c4_test", "c4", "c4_validation", "fineweb_edu")
TEXT_FILES = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text"}  # a file's loader
CACHE_ENV = "MONARCH_SKY_CACHE"  # where fetched tokenizers live (default ~/.cache/monarch-sky)


class HubAccessError(RuntimeError):
    """The hub refused or could not be reached; the message names the fix."""


def tokenizer_dir(repo: str) -> Path:
    return cache_root() / "tokenizers" / repo


def tokenizer_path(data) -> str:
    """The folder a job's tokenizer is read from: `data.tokenizer_path`, else where
    `fetch-tokenizer` puts `data.tokenizer_repo`."""
    if data.tokenizer_path:
        return str(Path(data.tokenizer_path).expanduser())
    return str(tokenizer_dir(data.tokenizer_repo))


def resolved(data) -> dict:
    """A job's data settings as a trainer reads them: both paths made absolute."""
    path = data.dataset_path and str(Path(data.dataset_path).expanduser())
    return {**data, "tokenizer_path": tokenizer_path(data), "dataset_path": path}


def tokenizer_problem(data) -> str | None:
    """Why a job's tokenizer cannot be loaded, with the fix; None if it can."""
    path = Path(tokenizer_path(data))
    if (path / "tokenizer.json").is_file() and (path / "tokenizer_config.json").is_file():
        return None
    if data.tokenizer_repo and not data.tokenizer_path:
        return (f"data.tokenizer_repo: {data.tokenizer_repo}'s tokenizer is not at {path}; fetch it with "
                f"`HF_TOKEN=... monarch-sky fetch-tokenizer {data.tokenizer_repo}` (sky/setup.sh does this on the cloud)")
    return (f"data.tokenizer_path: {path} has no tokenizer.json and tokenizer_config.json; point it at a "
            f"Hugging Face tokenizer folder, or set data.tokenizer_repo and run `monarch-sky fetch-tokenizer`")


def fetched_later(data) -> bool:
    """The tokenizer comes from the hub (`data.tokenizer_repo`): `monarch-sky fetch-tokenizer`
    or sky/setup.sh fetches it where the run trains, so a job that lacks it still validates
    (`config` previews it anywhere); `train` refuses to start without it."""
    return bool(data.tokenizer_repo) and not data.tokenizer_path


def offline(data) -> bool:
    """Whether trainers must keep off the hub: their data is a local folder (the shipped
    default, a bucket mount). Streaming a hub dataset needs it on."""
    return bool(data.dataset_path) and Path(data.dataset_path).expanduser().exists()


def fetch_tokenizer(repo: str, dest: Path | None = None) -> Path:
    """Download `repo`'s tokenizer files with HF_TOKEN (skipped when already there)."""
    dest = dest or tokenizer_dir(repo)
    download(repo, TOKENIZER_FILES, dest, field="data.tokenizer_repo",
             local_fix="copy a tokenizer folder and set data.tokenizer_path")
    if not (dest / "tokenizer.json").is_file():
        raise HubAccessError(f"data.tokenizer_repo: {repo} has no tokenizer.json; fix: name a repository "
                             f"with a Hugging Face tokenizer (e.g. meta-llama/Llama-3.1-8B)")
    return dest


def download(repo: str, patterns: list[str], dest: Path, field: str, local_fix: str) -> None:
    """`repo`'s files matching `patterns` into `dest` with HF_TOKEN (what is there is kept);
    HubAccessError naming `field` (the setting that names the repo) and the fix."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError

    token = os.environ.get("HF_TOKEN") or None
    page = f"https://huggingface.co/{repo}"
    try:
        snapshot_download(repo, allow_patterns=patterns, local_dir=dest, token=token)
    except GatedRepoError as e:
        who = "the HF_TOKEN given has no access" if token else "no HF_TOKEN was given"
        raise HubAccessError(f"HF_TOKEN: {repo} is gated and {who}; fix: accept its license at {page} "
                             f"and pass a token of that account (sky launch ... --secret HF_TOKEN)") from e
    except RepositoryNotFoundError as e:
        why = "or HF_TOKEN is not a valid token" if token else "or it is private and no HF_TOKEN was given"
        raise HubAccessError(f"{field}: {repo} was not found on the hub {why}; fix: check the "
                             f"name at {page} and pass --secret HF_TOKEN") from e
    except HfHubHTTPError as e:
        raise HubAccessError(f"HF_TOKEN: the hub refused {repo} ({e.response.status_code}); fix: check the token") from e
    except OSError as e:  # no route to the hub (LocalEntryNotFoundError, connection errors)
        raise HubAccessError(f"cannot fetch {repo} from the hub: {e}; fix: check the node's "
                             f"internet access, or {local_fix}") from e


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV) or "~/.cache/monarch-sky").expanduser()


def register_datasets() -> None:
    """Add your own text (`local_text`, read from `data.dataset_path`) and FineWeb-Edu (parquet,
    its 10B-token sample) to TorchTitan's dataset table."""
    from datasets import load_dataset
    from torchtitan.hf_datasets import DatasetConfig
    from torchtitan.hf_datasets.text_datasets import DATASETS

    DATASETS.setdefault(LOCAL_TEXT, DatasetConfig(
        path="",  # always data.dataset_path
        loader=partial(_local_text, load_dataset),
        sample_processor=lambda sample: sample["text"],
    ))
    DATASETS.setdefault("fineweb_edu", DatasetConfig(
        path="HuggingFaceFW/fineweb-edu",
        loader=partial(_stream, load_dataset, "sample-10BT"),
        sample_processor=lambda sample: sample["text"],
    ))


def _local_text(load_dataset, path: str):
    """A folder (its files as the hub would read them) or one file, by its extension."""
    if Path(path).is_dir():
        return load_dataset(path, split="train")
    return load_dataset(TEXT_FILES[Path(path).suffix], data_files=path, split="train")


def local_text_problem(path: str | None) -> str | None:
    """Why `data.dataset=local_text` cannot read `path`, with the fix; None if it can."""
    kinds = ", ".join(TEXT_FILES)
    if not path:
        return (f"data.dataset_path: {LOCAL_TEXT} reads your own text: give a file or folder of {kinds} "
                "(each record's text under \"text\"; .txt: one record per line)")
    found = Path(path).expanduser()
    files = [found] if found.is_file() else found.rglob("*")  # a bucket mount may hold many: stop at the first
    if not any(p.suffix in TEXT_FILES and p.is_file() for p in files):
        return f"data.dataset_path: '{path}' holds no {kinds} file for {LOCAL_TEXT}"
    return None


def tokenizer_vocab(data) -> int | None:
    """How many token ids the job's tokenizer makes (its tokenizer.json), or None if absent."""
    import json

    path = Path(tokenizer_path(data)) / "tokenizer.json"
    if not path.is_file():
        return None
    tokenizer = json.loads(path.read_text())
    ids = list((tokenizer.get("model") or {}).get("vocab", {}).values())
    ids += [t["id"] for t in tokenizer.get("added_tokens", [])]
    return max(ids) + 1 if ids else None


def _stream(load_dataset, name: str, path: str):
    return load_dataset(path, name=name, split="train", streaming=True)
