"""`monarch-sky fetch-tokenizer` and `fetch-weights`: what a cloud run needs from the Hugging Face
Hub, fetched on each node before training (sky/setup.sh), never by the trainers themselves."""

from __future__ import annotations

import sys


def fetch_tokenizer(args) -> int:
    from monarch_sky.common import hub_assets
    from monarch_sky.recipes import RECIPES

    repo = args.repo
    if repo is None and args.recipe is not None:
        if args.recipe not in RECIPES:
            print(f"monarch-sky: --recipe: unknown recipe '{args.recipe}'; one of {', '.join(RECIPES)}", file=sys.stderr)
            return 2
        repo = RECIPES[args.recipe].job_defaults.get("data", {}).get("tokenizer_repo")
        if repo is None:
            print(f"monarch-sky: {args.recipe} trains on its shipped tokenizer: nothing to fetch")
            return 0
    if repo is None:
        print("monarch-sky: fetch-tokenizer: name a hub repository or --recipe", file=sys.stderr)
        return 2
    try:
        path = hub_assets.fetch_tokenizer(repo)
    except hub_assets.HubAccessError as e:
        print(f"monarch-sky: {e}", file=sys.stderr)
        return 2
    print(f"monarch-sky: {repo}'s tokenizer is in {path}")
    return 0


def fetch_weights(job) -> int:
    """The job's init.weights_repo into this node's cache (sky/setup.sh runs it with the run's
    overrides); a run from scratch or from a local folder needs nothing."""
    from monarch_sky.common import hub_assets, released_weights
    from monarch_sky.config import EXIT_CONFIG
    from monarch_sky.model_shapes import weights_problem

    if job is None:
        return EXIT_CONFIG
    init = job.config.init
    if not released_weights.fetched_later(init):
        print(f"monarch-sky: the run starts from {released_weights.source(init)}: nothing to fetch")
        return 0
    print(f"monarch-sky: fetching {init.weights_repo}'s weights (safetensors) into {released_weights.weights_dir(init.weights_repo)}")
    try:
        path = released_weights.fetch(init.weights_repo)
    except hub_assets.HubAccessError as e:
        print(f"monarch-sky: {e}", file=sys.stderr)
        return 2
    if problem := weights_problem(job.config):
        print(f"monarch-sky: config error: {problem}", file=sys.stderr)
        return EXIT_CONFIG
    print(f"monarch-sky: {init.weights_repo}'s weights are in {path}")
    return 0
