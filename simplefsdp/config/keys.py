"""Checks of single ``[section]`` keys that ``JobConfig.validate`` runs before any work
(each takes the section, or the whole JobConfig, as ``config.job`` defines them): each
raises a ConfigError naming the key and the fix."""

from __future__ import annotations

from ..errors import ConfigError, choices, require


def check_layout_keys(p) -> None:
    """``parallel.memory_limit_gb`` > 0 and ``parallel.hardware`` a known profile."""
    from ..hardware import GPU_PROFILES

    limit = p.memory_limit_gb
    require(limit is None or limit > 0, "parallel.memory_limit_gb", limit,
            "> 0 (decimal GB per rank)")
    if p.hardware != "auto" and p.hardware not in GPU_PROFILES:
        raise ConfigError(f"parallel.hardware = {p.hardware!r} is not a device profile; "
                          f"choose 'auto' or one of {choices(GPU_PROFILES)}")


def check_expert_dispatch(p, family: str) -> None:
    """``parallel.expert_capacity_factor`` > 0 (the reader refuses inf and nan), and the
    padded dispatch only for our MoE family (the one whose routed layers honour it)."""
    factor = p.expert_capacity_factor
    require(factor > 0, "parallel.expert_capacity_factor", factor,
            "a finite number > 0 (e.g. 1.25: each expert takes 1.25x an even share of a "
            "rank's routed slots)")
    if p.expert_dispatch == "padded" and family != "moe":
        raise ConfigError(f"parallel.expert_dispatch = 'padded' needs model.family = 'moe' "
                          f"(our MoE presets), but model.family = {family!r}: set "
                          f"parallel.expert_dispatch = 'exact'")


def check_etp(cfg, family: str, dims) -> None:
    """``parallel.etp``: 1, or ``parallel.tp`` (each routed expert's width split over the
    TP ranks and stored split, ``parallel/expert_tensor.py``), and then only where it is
    built: our MoE family, a width ``tp`` divides, ``ep`` groups carved out of the ranks
    that are not TP peers (``ParallelDims.etp_expert_ranks``), the exact dispatch. ``dims``: the
    ``ParallelDims`` (the ``ep`` rule only once resolved: ``dp_shard = -1`` has no size yet)."""
    p = cfg.parallel
    if p.etp == 1:
        return
    if p.etp != p.tp:
        raise ConfigError(f"parallel.etp = {p.etp!r} must be 1 or parallel.tp = {p.tp} (the "
                          f"routed experts are split over the whole TP group or not at all); "
                          f"set parallel.etp = {p.tp} or 1")
    refusals = [
        (family != "moe", f"model.family = {family!r}: expert tensor parallelism is built "
                          f"for our MoE presets"),
        (p.expert_dispatch != "exact", "parallel.expert_dispatch = 'padded': the padded "
                                       "dispatch is not split over TP"),
    ]
    for refused, why in refusals:
        if refused:
            raise ConfigError(f"parallel.etp = {p.etp} cannot be combined with {why}; set "
                              f"parallel.etp = 1")
    width = cfg.model.model_args().moe_hidden_dim
    if width % p.etp:
        raise ConfigError(f"parallel.etp = {p.etp} does not divide the routed experts' width "
                          f"model.moe_hidden_dim = {width}; pick a width it divides or set "
                          f"parallel.etp = 1")
    if not dims.resolved:  # dp_shard = -1: checked once the world is known (the
        return  # trainer's resolved config, the planner's ``predict``)
    ranks, names = dims.etp_expert_ranks(p.dp_mode)
    try:
        dims.check_ep(p.ep, ranks, names, f"with parallel.etp = {p.etp} the TP peers hold "
                      f"the same experts, each a slice of their width", "parallel.")
    except ValueError as error:
        raise ConfigError(f"{error}; set parallel.ep to a divisor of {ranks} or "
                          f"parallel.etp = 1") from None


def check_hf_balance(m) -> None:
    """``model.router_aux_loss_coef`` is a Hugging Face folder's key (our MoE has
    ``aux_loss_coef``) and a weight: >= 0. Whether the folder is an MoE with a balance loss
    is ``hf.hooks.validate_folder``'s check (it reads config.json)."""
    coef = m.router_aux_loss_coef
    if coef is None:
        return
    if m.hf_path is None:
        raise ConfigError(f"model.router_aux_loss_coef = {coef} overrides a Hugging Face MoE "
                          f"folder's balance loss (model.hf_path), but model.hf_path is not "
                          f"set; for our MoE presets use model.aux_loss_coef")
    require(coef >= 0, "model.router_aux_loss_coef", coef, ">= 0 (0 turns the balance loss off)")


def check_data(cfg) -> None:
    """``[data]``: the sources exist and match the weights; the mask's limits."""
    from ..corpus.sources import resolve_all

    d = cfg.data
    resolve_all(d.dataset, list(d.weights))
    require(d.tokenize_workers >= 0, "data.tokenize_workers", d.tokenize_workers, ">= 0")
    if d.document_mask and (cfg.parallel.pp > 1 or cfg.model.hf_path is not None):
        raise ConfigError("data.document_mask = true works with our Llama without pipeline "
                          "stages: set parallel.pp = 1 and leave model.hf_path unset, or "
                          "turn data.document_mask off")
