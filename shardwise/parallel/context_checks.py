"""Context parallelism's own constraints (``--cp``, ``--cp-impl``), checked before launch; pure.
It cuts every sequence into 2 x cp chunks (parallel/context.py), so the sequence length must
divide by 2 x cp; Ulysses splits the heads (tp-local) over cp. Not built yet with sequence
parallelism, HSDP or dropout: each refused here. Models: shardwise's GPT, Hugging Face
GPT-2 and Llama, and a person's model whose plan names its attention and positions (checked
when the model is prepared: parallel/context.py); LeNet is refused here."""
from __future__ import annotations

from shardwise.config import Config, ConfigError
from shardwise.parallel.presets import DATA_MODEL


def reads(cfg: Config) -> dict[str, bool]:
    """--cp is read by the composed layouts; --cp-impl only with cp > 1."""
    p = cfg.parallel
    return {"cp": p.strategy in DATA_MODEL, "cp_impl": p.strategy in DATA_MODEL and p.cp > 1}


def check(cfg: Config, world_size: int) -> None:
    m, p = cfg.model, cfg.parallel
    if p.cp == 1:                       # below 1: refused with the other sizes (validate)
        return
    if m.name == "lenet":
        raise ConfigError("parallel.cp", p.cp, "context parallelism cuts sequences, and LeNet "
                          "reads images", "a sequence model (--model gpt, hf:gpt2, hf:llama), "
                          "or drop --cp")
    if m.block_size % (2 * p.cp):
        raise ConfigError("model.block_size", m.block_size, f"--cp {p.cp} cuts each sequence into "
                          f"2 x cp = {2 * p.cp} chunks (causal load balancing), which do not "
                          "divide it", f"a --block-size divisible by {2 * p.cp}, or another --cp")
    heads = m.n_head // p.tp if m.n_head % p.tp == 0 else m.n_head
    if p.cp_impl == "ulysses" and heads % p.cp:
        raise ConfigError("parallel.cp_impl", "ulysses", f"splits the {heads} heads of a rank "
                          f"(n_head {m.n_head} / tp {p.tp}) over cp = {p.cp}, which do not divide "
                          "them", f"--cp-impl ring, or a --cp that divides {heads}")
    for on, field, value, what in ((p.sequence_parallel, "parallel.sequence_parallel", True,
                                    "sequence parallelism"),
                                   (p.dp_shard > 0 or p.dp_replicate > 0, "parallel.dp_shard",
                                    p.dp_shard, "HSDP"),
                                   (m.dropout > 0, "model.dropout", m.dropout, "dropout")):
        if on:
            raise ConfigError(field, value, f"context parallelism (--cp {p.cp}) does not run "
                              f"with {what} yet", f"drop --cp, or drop {what}")
