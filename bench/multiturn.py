"""Multi-turn environments on the real model: does a tool lift held-out reward, and do the turns
to success fall as a game is learned?

    python bench/real_model.py fetch                 # once: SmolLM2-135M-Instruct into the cache
    python bench/multiturn.py calculator             # about 3 min on one H200
    python bench/multiturn.py guess                  # about 3 min on one H200
    python bench/multiturn.py calculator --dry-run   # the tiny model on a CPU, a few steps

``calculator``: 4-digit ``+ - *`` problems (``builtin:calculator``), one member trained with the
calculator tool; held-out mean return (the share solved, greedy) is measured with the tool and
without it (the same seeds, ``task.env.tools: false``) before and after training.
``guess``: guess-the-number from 1 to 16 with higher/lower feedback (``builtin:guess_number``);
held-out success rate and mean turns to success every ``--eval-every`` steps.

Prints one line per evaluation and writes every figure, the manifest and the versions to
``bench/results/multiturn-<game>-<UTC date>.json`` (``--out`` to change).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import time
from pathlib import Path

MODEL = "builtin:smollm2-135m-instruct"
GAMES = {
    "calculator": {"class": "builtin:calculator", "kwargs": {"digits": 4, "max_turns": 3}},
    "guess": {"class": "builtin:guess_number", "kwargs": {"low": 1, "high": 16, "max_turns": 6}},
}


def sections(game: str, dry_run: bool, steps: int, engine: str) -> dict:
    """The manifest: the real model on a GPU, or the tiny one on a CPU for a dry run."""
    env = {**GAMES[game], "max_episode_tokens": 384}
    return {
        "model": {"name": "builtin:tiny" if dry_run else MODEL},
        "lora": {"r": 16, "alpha": 32},
        "optim": {"lr": 5.0e-3 if dry_run else 2.0e-4},
        "algorithm": {
            "name": "GRPO",
            "group_size": 4 if dry_run else 8,
            "prompts_per_step": 2 if dry_run else 16,
            "beta": 0.0,
        },
        "rollout": {
            "engine": engine,
            "temperature": 1.0,
            "max_output_tokens": 8 if dry_run else 64,
        },
        "task": {"env": env, "eval_size": 4 if dry_run else 64, "train_size": 4096},
        "training": {
            "steps": steps,
            "seed": 0,
            "device": "cpu" if dry_run else "cuda",
            "output_dir": "runs/bench-multiturn",
        },
    }


def measure(game: str, dry_run: bool, steps: int, eval_every: int, engine: str) -> dict:
    """Train one member ``steps`` steps on ``game``; the held-out figures along the way."""
    import torch

    from pbt.algorithms.envs.episodes import episode_figures
    from pbt.algorithms.runtime.member import Member
    from pbt.config.read.loader import manifest_from_dict

    manifest = manifest_from_dict(sections(game, dry_run, steps, engine))
    member = Member(manifest, torch.device(manifest.training.device))
    learner, task = member.learner, member.task
    without = dataclasses.replace(task.reward, use_tools=False)

    def evaluate(label: str) -> dict:
        start = time.perf_counter()
        figures = {"step": learner.step, **episode_figures(learner, task.eval, task.reward)}
        if game == "calculator":
            bare = episode_figures(learner, task.eval, without)
            figures |= {f"no_tool_{k}": v for k, v in bare.items()}
        figures["eval_s"] = time.perf_counter() - start
        print(f"{label} step {learner.step:>3}: {_line(figures)}", flush=True)
        return figures

    started = time.perf_counter()
    evaluations, train_log = [evaluate("eval ")], []
    while learner.step < steps:
        chunk = min(eval_every, steps - learner.step)
        for metrics in member.train(chunk):
            train_log.append(metrics)
            print(f"train step {metrics['step']:>3}: {learner.describe(metrics)}  turns "
                  f"{metrics['reward/turns']:.2f}  tool calls {metrics['reward/tool_calls']:.2f}",
                  flush=True)  # fmt: skip
        evaluations.append(evaluate("eval "))
    return {
        "game": game,
        "model": manifest.model.name,
        "device": torch.cuda.get_device_name()
        if torch.cuda.is_available()
        else platform.processor(),
        "torch": torch.__version__,
        "seconds": time.perf_counter() - started,
        "sections": sections(game, dry_run, steps, engine),
        "evaluations": evaluations,
        "train": train_log,
    }


def _line(f: dict) -> str:
    text = (
        f"return {f['return']:.3f}  success {f['success']:.3f}  turns {f['turns']:.2f}  "
        f"turns to success {f['success_turns']:.2f}  tool calls {f['tool_calls']:.2f}"
    )
    if "no_tool_return" in f:
        text += f"  | without the tool: return {f['no_tool_return']:.3f}"
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("game", choices=sorted(GAMES))
    parser.add_argument("--dry-run", action="store_true", help="the tiny model on the CPU")
    parser.add_argument("--steps", type=int, help="training steps (30 on a GPU, 2 dry)")
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--engine", choices=["hf", "static"], default="hf")
    parser.add_argument("--out", help="the JSON file (default bench/results/...)")
    args = parser.parse_args()
    steps = args.steps or (2 if args.dry_run else 30)
    result = measure(args.game, args.dry_run, steps, args.eval_every, args.engine)
    result["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    result["command"] = "python bench/multiturn.py " + " ".join(
        f"{k}={v}" for k, v in vars(args).items()
    )
    stamp = time.strftime("%Y%m%d", time.gmtime())
    dry = "-dry" if args.dry_run else ""
    out = Path(args.out or f"bench/results/multiturn-{args.game}{dry}-{stamp}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
