"""The table of AgileRL's keys: for each, where its value lands and what it means here.

A rule converts a value into assignments to dotted manifest paths, a note (the key changes
nothing here), or a problem (obeying it would change results, so it is refused with the fix).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class Outcome:
    """What one key's value became."""

    sets: tuple[tuple[str, Any], ...] = ()
    note: str = ""
    problem: str = ""


@dataclass(frozen=True, slots=True)
class KeyRule:
    """One AgileRL key: the manifest paths it sets, its meaning, and its conversion."""

    targets: tuple[str, ...]
    meaning: str
    convert: Callable[[Any], Outcome]


@dataclass(slots=True)
class Translation:
    """What AgileRL's keys became: values per dotted manifest path, notes, problems."""

    sets: list[tuple[str, Any, str]] = field(default_factory=list)
    """``(path, value, origin)``; ``origin`` names the AgileRL key in messages."""
    notes: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    def apply(self, rule: KeyRule, origin: str, value: Any) -> None:
        """Run one key's rule and keep what it yields."""
        outcome = rule.convert(value)
        self.sets += [(path, v, origin) for path, v in outcome.sets]
        if outcome.note:
            self.notes.append(f"{origin} ({value!r}): {outcome.note}")
        if outcome.problem:
            self.problems.append(f"{origin} ({value!r}) {outcome.problem}")

    def write(self, sections: dict[str, Any]) -> None:
        """Assign every value into ``sections``; a value the manifest also gives differently is
        a contradiction, reported, not resolved."""
        self._fit_tournament()
        for path, value, origin in self.sets:
            *parents, name = path.split(".")
            block: Any = sections
            for part in parents:
                block = block.setdefault(part, {})
                if not isinstance(block, dict):
                    break  # reported when the section itself is built
            else:
                if name in block and block[name] != value:
                    self.problems.append(
                        f"{origin} ({value!r}) contradicts {path} ({block[name]!r}); give it in "
                        "one place"
                    )
                block[name] = value

    def _fit_tournament(self) -> None:
        """AgileRL's single-agent configs pair ``POP_SIZE: 1`` with ``TOURN_SIZE: 2``; a
        tournament cannot hold more members than the population, so for a population of one it
        is cut to one (with a note): with one member there is nothing to select either way."""
        given = {path: (value, origin) for path, value, origin in self.sets}
        size, tournament = given.get("population.size"), given.get("population.tournament_size")
        if size is not None and size[0] == 1 and tournament is None:
            # AgileRL's multi-turn configs give POP_SIZE 1 and no tournament at all
            self.sets.append(("population.tournament_size", 1, size[1]))
            self.notes.append(f"{size[1]} (1): one member has no tournament; tournament_size is 1")
            return
        if size is None or tournament is None:
            return
        if not all(isinstance(v[0], int) and v[0] > 0 for v in (size, tournament)):
            return  # the manifest's own checks report such values
        if size[0] != 1 or tournament[0] <= 1:
            return  # a real population with too large a tournament is the user's to fix
        self.sets = [entry for entry in self.sets if entry[0] != "population.tournament_size"]
        self.sets.append(("population.tournament_size", 1, tournament[1]))
        self.notes.append(
            f"{tournament[1]} ({tournament[0]!r}): a tournament cannot hold more than the one "
            f"member of {size[1]}; tournament_size is 1"
        )


def _to(*paths: str) -> Callable[[Any], Outcome]:
    return lambda value: Outcome(sets=tuple((p, value) for p in paths))


def _rule(meaning: str, *paths: str) -> KeyRule:
    return KeyRule(paths, meaning, _to(*paths))


def _note(meaning: str, note: str) -> KeyRule:
    return KeyRule((), meaning, lambda value: Outcome(note=note))


def _refuse_unless(
    ok: Callable[[Any], bool], meaning: str, problem: str, note: str = ""
) -> KeyRule:
    """Refused when ``ok(value)`` is false (obeying would change results); else a note, if any."""
    return KeyRule((), meaning, lambda v: Outcome(note=note) if ok(v) else Outcome(problem=problem))


ALGO_NAMES: dict[str, tuple[str, str | None]] = {
    "GRPO": ("GRPO", None),
    "CISPO": ("GRPO", "cispo"),
    "GSPO": ("GRPO", "gspo"),
    "LLMPPO": ("PPO", None),
    "PPO": ("PPO", None),
    "LLMREINFORCE": ("REINFORCE", None),
    "REINFORCE": ("REINFORCE", None),
    "SFT": ("SFT", None),
    "DPO": ("DPO", None),
}
"""AgileRL's algorithm names -> (``algorithm.name``, ``algorithm.loss`` or None)."""


def _algo(value: Any) -> Outcome:
    if str(value).upper() not in ALGO_NAMES:
        return Outcome(sets=(("algorithm.name", value),))  # refused there, with a suggestion
    name, loss = ALGO_NAMES[str(value).upper()]
    sets = (("algorithm.name", name),) + ((("algorithm.loss", loss),) if loss else ())
    return Outcome(sets=sets)


def _cosine(value: Any) -> Outcome:
    if value is None or value is False:
        return Outcome(sets=(("optim.schedule", "constant"),))
    extra = value if isinstance(value, dict) else {}
    if extra.get("warmup_proportion"):
        return Outcome(
            problem="sets a warmup as a share of epochs, which this step-driven run has not; "
            "give optim.warmup_steps (optimizer steps of linear warmup) and optim.schedule: cosine"
        )
    note = "the cosine decays to 0 over each member's training.steps" if extra else ""
    return Outcome(sets=(("optim.schedule", "cosine"),), note=note)


def _vllm_config(value: Any) -> Outcome:
    own = {"tensor_parallel_size", "gpu_memory_utilization", "max_num_seqs", "sleep_mode",
           "max_model_len", "enforce_eager", "enable_prefix_caching"}  # fmt: skip
    if not isinstance(value, dict):
        return Outcome(problem="must be a mapping of vLLM settings")
    other = sorted(set(value) - own)
    if other:
        return Outcome(
            problem=f"has {', '.join(other)}: a vLLM server is not used here, the engine is "
            f"colocated with each rank; set only {', '.join(sorted(own))} (rollout.vllm)"
        )
    return Outcome(sets=tuple((f"rollout.vllm.{k}", v) for k, v in value.items()))


_LORA_KEYS = {"r": "r", "lora_r": "r", "lora_alpha": "alpha", "alpha": "alpha",
              "lora_dropout": "dropout", "dropout": "dropout", "target_modules": "target_modules"}  # fmt: skip


def lora(value: Any) -> Outcome:
    """A peft ``LoraConfig``'s fields (AgileRL's ``LORA`` / ``network.lora_config``) -> ``lora``."""
    if not isinstance(value, dict):
        return Outcome(problem="must be a mapping of LoraConfig fields (r, lora_alpha, ...)")
    sets, problems = [], []
    for key, v in value.items():
        if key in _LORA_KEYS:
            sets.append((f"lora.{_LORA_KEYS[key]}", v))
        elif (key, v) in (("bias", "none"), ("task_type", "CAUSAL_LM")):
            continue  # what the adapter here always is
        else:
            problems.append(f"{key}: {v!r}")
    if problems:
        return Outcome(
            problem=f"has {', '.join(problems)}, which the adapter here does not support; it "
            "takes r, lora_alpha, lora_dropout, target_modules (bias none, task_type CAUSAL_LM)"
        )
    return Outcome(sets=tuple(sets))


_NO_ARCH = (
    "is refused: an LLM member's architecture is the base model's and its weights change only "
    "by training; set it to 0"
)

INIT_HP_RULES: dict[str, KeyRule] = {
    "ALGO": KeyRule(
        ("algorithm.name", "algorithm.loss"),
        "the algorithm; CISPO and GSPO are GRPO "
        "with that loss, LLMPPO is PPO, LLMREINFORCE is REINFORCE",
        _algo,
    ),
    "BATCH_SIZE": _rule("prompts per training step", "algorithm.prompts_per_step"),
    "GROUP_SIZE": _rule("completions sampled per prompt", "algorithm.group_size"),
    "LR": _rule("learning rate", "optim.lr"),
    "BETA": _rule("KL coefficient against the reference", "algorithm.beta"),
    "CLIP_COEF": _rule("both clip bounds", "algorithm.clip_low", "algorithm.clip_high"),
    "MAX_GRAD_NORM": _rule("gradient clipping", "optim.max_grad_norm"),
    "UPDATE_EPOCHS": _rule("passes over each rollout batch", "algorithm.update_epochs"),
    "TEMPERATURE": _rule("sampling temperature", "rollout.temperature"),
    "MAX_OUTPUT_TOKENS": _rule("longest completion", "rollout.max_output_tokens"),
    "MIN_OUTPUT_TOKENS": KeyRule(
        ("rollout.min_output_tokens",),
        "shortest completion; null is 0",
        lambda v: Outcome(sets=(("rollout.min_output_tokens", v or 0),)),
    ),
    "MAX_MODEL_LEN": _rule(
        "longest prompt + completion of the vLLM engine", "rollout.vllm.max_model_len"
    ),
    "COSINE_lR_SCHEDULER": KeyRule(
        ("optim.schedule",),
        "null: constant; a mapping: cosine decay over the member's steps",
        _cosine,
    ),
    "LORA": KeyRule(("lora",), "the LoRA adapter (peft LoraConfig fields)", lora),
    "LORA_R": _rule("adapter rank", "lora.r"),
    "LORA_ALPHA": _rule("adapter scaling numerator", "lora.alpha"),
    "LORA_DROPOUT": _rule("adapter dropout", "lora.dropout"),
    "TARGET_MODULES": _rule("adapted modules", "lora.target_modules"),
    "LORA_BIAS": _refuse_unless(
        lambda v: v == "none",
        "adapter bias: none only",
        "is refused: the adapter trains no biases; set none",
    ),
    "MICRO_BATCH_SIZE_PER_GPU": _rule(
        "completions per forward/backward", "algorithm.micro_batch_size"
    ),
    "BATCH_SIZE_PER_GPU": _rule("completions per forward/backward", "algorithm.micro_batch_size"),
    "DATA_BATCH_SIZE_PER_GPU": _rule("prompts per step", "algorithm.prompts_per_step"),
    "USE_VLLM": KeyRule(
        ("rollout.engine",),
        "true: the colocated vLLM engine; false: HF generate",
        lambda v: Outcome(sets=(("rollout.engine", "vllm" if v else "hf"),)),
    ),
    "VLLM_CONFIG": KeyRule(("rollout.vllm",), "the colocated engine's settings", _vllm_config),
    "FSDP": _rule("true or FSDPConfig fields: FSDP2 sharding", "distributed.fsdp"),
    "GAMMA": _rule("PPO discount per token", "algorithm.gamma"),
    "GAE_LAMBDA": _rule("PPO's GAE lambda", "algorithm.lam"),
    "VF_COEF": _rule("PPO value-loss weight", "algorithm.vf_coef"),
    "LOSS_TYPE": _rule("the GRPO-family objective", "algorithm.loss"),
    "SEED": _rule("the campaign's seed", "training.seed"),
    "POP_SIZE": _rule("members in the population", "population.size"),
    "TOURN_SIZE": _rule("tournament size", "population.tournament_size"),
    "TOURNAMENT_SIZE": _rule("tournament size (pbt-llm's spelling)", "population.tournament_size"),
    "ELITISM": _rule("keep the best member unchanged", "population.elitism"),
    "EVO_STEPS": _rule("training steps between selections", "population.evo_steps"),
    "EVAL_LOOP": _rule("latest evaluations averaged into fitness", "population.fitness_window"),
    "ADV_NORM": _rule(
        "group advantages: mean_std (r - mean) / std, or mean_only r - mean",
        "algorithm.advantage_norm",
    ),
    "USE_KL_ADVANTAGE_SHAPING": _rule(
        "the KL folded into each token's advantage instead of a loss term",
        "algorithm.kl_in_advantage",
    ),
    "FILTER_ZERO_ADV": _refuse_unless(
        lambda v: not v,
        "false (with a note); true is refused",
        "is refused: a completion whose own advantage is 0 in a group with signal stays in the "
        "loss here (whole groups without signal are always left out); set false",
        note="groups whose rewards are all equal (every advantage 0) are always left out of the "
        "loss here, where AgileRL keeps them: no policy term changes, but the loss is averaged "
        "over the tokens that carry signal and those groups add no KL term",
    ),
    "CALC_POSITION_EMBEDDINGS": _note(
        "ignored", "position ids are always computed from the attention mask here; nothing to set"
    ),
    "REDUCE_MEMORY_PEAK": _note(
        "ignored", "memory is bounded by algorithm.micro_batch_size here; set that instead"
    ),
    "USE_MEMORY_EFFICIENT_PARAMS": _note(
        "ignored", "members share one frozen base and hold only their adapters; nothing to set"
    ),
    "USE_LIGER_LOSS": _note(
        "ignored",
        "the loss kernel here is the project's own lean log-prob path; the result is the same",
    ),
    "GRADIENT_CHECKPOINTING": _note(
        "ignored",
        "a memory setting AgileRL's trainer applies; this trainer does not checkpoint activations",
    ),
    "USE_SEPARATE_REFERENCE_ADAPTER": _note(
        "ignored",
        "the reference here is the base model "
        "(adapter disabled), which a fresh adapter starts "
        "from",
    ),
}
"""``INIT_HP`` keys (also the lowercase ``algorithm:`` keys of AgileRL's manifest, uppercased)."""

MUTATION_RULES: dict[str, KeyRule] = {
    "NO_MUT": _rule("relative probability of no mutation", "mutation.no_mutation"),
    "RL_HP_MUT": _rule("relative probability of a hyperparameter mutation", "mutation.rl_hp"),
    "ARCH_MUT": _refuse_unless(lambda v: not v, "0 only", _NO_ARCH),
    "NEW_LAYER": _refuse_unless(lambda v: not v, "0 only", _NO_ARCH),
    "PARAMS_MUT": _refuse_unless(lambda v: not v, "0 only", _NO_ARCH),
    "ACT_MUT": _refuse_unless(lambda v: not v, "0 only", _NO_ARCH),
    "MUT_SD": _note(
        "ignored",
        "the noise of AgileRL's parameter mutation, which LLM members do "
        "not use; hyperparameters move by mutation.ranges' grow and shrink factors",
    ),
    "RAND_SEED": _rule("the campaign's seed: selection and mutation draw from it", "training.seed"),
    "MUTATE_ELITE": _rule("mutate the elite too", "mutation.mutate_elite"),
    "RL_HP_SELECTION": KeyRule(
        ("mutation.ranges",), "restricts the ranges to these names", lambda v: Outcome()
    ),
}
"""``MUTATION_PARAMS`` keys (also ``mutation:`` and ``mutation.probabilities:``, uppercased)."""

RANGE_NAMES: dict[str, tuple[tuple[str, str | None], ...]] = {
    "clip_coef": (("clip_low", None), ("clip_high", None)),
    "batch_size": (("prompts_per_step", "int"),),
    "group_size": (("group_size", "int"),),
}
"""AgileRL's hyperparameter names whose range lands under other names or is integer."""


def _engines(value: Any) -> Outcome:
    if value == "auto":
        return Outcome(sets=(("launch.rollout_gpus_per_member", "auto"),))
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        return Outcome(
            problem="must be a whole number >= 0 (0: colocated rollouts) or auto; e.g. 1"
        )
    return Outcome(sets=(("launch.rollout_gpus_per_member", value),))


ROLLOUT_MODES = {"colocated": "sync", "sync": "sync", "async": "async"}
"""Arena's ``rollout_mode`` values -> ``rollout.mode``."""


def _rollout_mode(value: Any) -> Outcome:
    if value not in ROLLOUT_MODES:
        return Outcome(
            problem=f"must be one of {', '.join(ROLLOUT_MODES)}; async samples on the member's "
            "dedicated engines (rollout_engines_per_agent) while it trains"
        )
    return Outcome(sets=(("rollout.mode", ROLLOUT_MODES[value]),))


TRAINING_RULES: dict[str, KeyRule] = {
    "MAX_STEPS": _rule("training steps summed over all members", "budget.total_steps"),
    "EVO_STEPS": INIT_HP_RULES["EVO_STEPS"],
    "POP_SIZE": INIT_HP_RULES["POP_SIZE"],
    "EVAL_LOOP": INIT_HP_RULES["EVAL_LOOP"],
    "EVALUATION_INTERVAL": _rule("evaluate every N steps", "training.eval_every"),
    "TARGET_SCORE": _rule("stop at this fitness", "budget.target_fitness"),
    "MAX_WALL_SECONDS": _rule("stop after this wall time", "budget.wall_time_s"),
    "NUM_EPOCHS": _note(
        "ignored",
        "the run is step-driven: budget.total_steps (max_steps) and population.evo_steps end it",
    ),
    "TRAINING_GPUS_PER_AGENT": _rule("GPUs (ranks) of each member", "launch.gpus_per_member"),
    "ROLLOUT_BATCH_SIZE": _rule(
        "prompts (groups) per step; a multiple of training_gpus_per_agent",
        "algorithm.prompts_per_step",
    ),
    "ROLLOUT_ENGINES_PER_AGENT": KeyRule(
        ("launch.rollout_gpus_per_member",),
        "dedicated rollout engines per member (0: colocated)",
        _engines,
    ),
    "ROLLOUT_MODE": KeyRule(
        ("rollout.mode",), "colocated/sync, or async (samples ahead on the engines)", _rollout_mode
    ),
    "WEIGHT_SYNC_INTERVAL": _refuse_unless(
        lambda v: v == 1,
        "1 only: the adapter crosses after every step",
        "would let the engines lag several steps between adapter syncs, which this trainer "
        "does not do (it sends the adapter after every step); remove it or set it to 1",
    ),
    "WEIGHT_SYNC_BACKEND": _note(
        "ignored",
        "the adapter crosses to an engine on the same host through shared memory, LoRA only",
    ),
}
"""The ``training:`` keys of AgileRL's manifest (uppercased), the Arena keys among them."""


def _version_lag(value: Any) -> Outcome:
    if value is None:
        return Outcome(
            note="an unbounded lag has no equivalent here; rollout.max_staleness keeps its "
            "value (0 by default: every batch drawn with the current adapter)"
        )
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        return Outcome(problem="must be a whole number >= 0 (0: no lag); e.g. 1")
    return Outcome(sets=(("rollout.max_staleness", value),))


def _buffer_kind(value: Any) -> Outcome:
    if value == "llm":
        return Outcome()
    return Outcome(
        problem="is AgileRL's buffer for off-policy agents; an LLM member's async rollouts "
        "queue on its engines: set kind: llm"
    )


_NO_BUFFER = (
    "a member's engine queues at most max_staleness / (optimizer steps per step) batches "
    "ahead; there is no buffer to size"
)

REPLAY_BUFFER_RULES: dict[str, KeyRule] = {
    "KIND": KeyRule((), "llm: the async rollout queue", _buffer_kind),
    "MAX_ROLLOUT_VERSION_LAG": KeyRule(
        ("rollout.max_staleness",),
        "adapter versions a sample may lag; x algorithm.update_epochs optimizer steps",
        _version_lag,
    ),
    "MAX_SIZE": _note("ignored", _NO_BUFFER),
    "MEMORY_SIZE": _note("ignored", _NO_BUFFER),
    "BUFFER_OCCUPANCY_MULTIPLIER": _note("ignored", _NO_BUFFER),
    "NAME": _note("ignored", "a label for AgileRL's logs"),
}
"""The ``replay_buffer:`` keys of AgileRL's manifest (uppercased): Arena's async rollout queue.
A version there is one weight sync, after each learning step; here a step takes
``update_epochs`` optimizer steps, in which ``rollout.max_staleness`` counts."""
