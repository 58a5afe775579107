"""Parallel degrees, their rules, the device mesh, and this rank's place in it.

:class:`ParallelDims` is the one owner of these facts: the degrees ``pp, dp_replicate,
dp_shard, cp_ring, cp_ulysses, tp, ep``, ``dp_shard = -1`` filled in from the world size,
every divisibility rule, the mesh (named dims ``MESH_DIMS``; dims of size 1 are kept so
that ``mesh["dp_shard"]`` always exists), the meshes derived from it and a rank's
coordinates. The trainer, the planner and the benchmark ask it; nothing else multiplies
degrees or computes a rank's coordinates.

Context parallelism (``parallel/context.py``) has two degrees: ``cp_ulysses`` (heads
exchanged for sequence, neighbouring ranks) inside ``cp_ring`` (K/V shared around a
ring); ``cp`` is their product. The ``cp`` ranks of one data-parallel slice read the same
batch and each keeps its part of the sequence; they hold the same weights, so parameters
are sharded over ``dp_shard x cp`` (:meth:`ParallelDims.data_parallel_mesh`).

``ep`` (expert parallelism) is no dim of the job mesh: its groups are carved out of
``dp_shard x cp x tp`` (``dp_replicate`` too in the ``replicate`` mode) on the experts' own
mesh (:meth:`ParallelDims.expert_mesh`).

Errors are ValueErrors naming each size as the caller spells it (``prefix``:
``"parallel."`` for the trainer's ``[parallel]`` section, empty for keyword arguments).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_tensor

from ._torch_compat import flatten_mesh, slice_flattened
from .shared_groups import shared_mesh, stage_group  # noqa: F401 - stage_group: imported from here

# The built mesh, outermost first.
MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp_ring", "cp_ulysses", "tp")
# The experts' mesh (ParallelDims.expert_mesh): the job mesh with dp_shard split, ep inside.
EXPERT_MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "ep", "cp_ring", "cp_ulysses", "tp")
CP_DIMS = ("cp_ring", "cp_ulysses")  # context parallelism: Ulysses inside, ring across
DEGREES = ("pp", "dp_replicate", "dp_shard", *CP_DIMS, "tp", "ep")


# The key of the node metadata (``node.meta["custom"]``) that names the data-parallel
# process groups of the collectives our parametrization issues: set at trace time
# (``torch.fx.traceback.annotate``, which AOTAutograd carries onto the backward's
# reductions and the recomputed gathers), read by the compiler's passes, which touch only
# those collectives, never tensor/sequence-parallel, pipeline or user ones.
DP_GROUPS_META = "simplefsdp_data_parallel_groups"


@dataclass(frozen=True)
class Coords:
    """One rank's coordinates in the mesh, and what follows from them."""

    pp: int
    dp_replicate: int
    dp_shard: int
    tp: int
    pp_size: int
    dp: int  # this rank's data-parallel index: which slice of the global batch it reads
    dp_size: int  # data-parallel ranks: slices of the global batch
    cp_ring: int = 0  # context parallel: this rank's place in its ring ...
    cp_ulysses: int = 0  # ... and in its Ulysses group (parallel/context.py's layout)

    @property
    def first(self) -> bool:
        """On the first pipeline stage (it reads the inputs)."""
        return self.pp == 0

    @property
    def last(self) -> bool:
        """On the last pipeline stage (it computes the loss)."""
        return self.pp == self.pp_size - 1

    @property
    def counts_tokens(self) -> bool:
        """The ranks of its data-parallel slice that count the batch's tokens: TP ranks
        and pipeline stages see the same tokens (one counts), context-parallel ranks
        each their own part of the sequence (each counts)."""
        return self.first and self.tp == 0

    @property
    def counts_loss(self) -> bool:
        """The ranks of its data-parallel slice whose losses are summed into the step's
        (one per context-parallel rank: each holds the loss of its own tokens)."""
        return self.last and self.tp == 0


@dataclass(frozen=True)
class ParallelDims:
    """The parallel degrees of a job; ``dp_shard = -1`` means the rest of the world size
    (:meth:`resolve` fills it in). Construction checks each size's range."""

    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = -1
    cp_ring: int = 1
    cp_ulysses: int = 1
    tp: int = 1
    ep: int = 1
    prefix: str = dataclasses.field(default="", compare=False)

    def __post_init__(self) -> None:
        for name in DEGREES:
            size = getattr(self, name)
            rest = name == "dp_shard" and size == -1
            if not isinstance(size, int) or isinstance(size, bool) or (size < 1 and not rest):
                extra = " or -1 (the rest of the world size)" if name == "dp_shard" else ""
                raise ValueError(f"{self.prefix}{name} = {size!r} is out of range: it must be "
                                 f"a positive integer{extra}")
        if self.dp_shard != -1:
            self._check_ep_source()

    def _check_ep_source(self) -> None:
        """:meth:`check_ep` on the sizes: the ranks the ``ep`` groups are carved out of are
        :attr:`expert_ranks`, or ``dp_replicate`` where those are 1."""
        if self.expert_ranks > 1:
            self.check_ep(self.ep, self.expert_ranks, self._expert_names(),
                          "the experts are sharded over those ranks", self.prefix)
        else:
            self.check_ep(self.ep, self.dp_replicate, f"{self.prefix}dp_replicate",
                          f"with {self.prefix}dp_shard = 1 the expert-parallel groups are "
                          f"carved out of the replicas", self.prefix)

    @property
    def resolved(self) -> bool:
        return self.dp_shard != -1

    @property
    def cp(self) -> int:
        """Context-parallel ranks per data-parallel slice: ``cp_ring * cp_ulysses``."""
        return self.cp_ring * self.cp_ulysses

    def _names(self, *dims: str) -> str:
        dims = tuple(d for n in dims for d in (CP_DIMS if n == "cp" else (n,)))
        used = [d for d in dims if d not in CP_DIMS or getattr(self, d) > 1]  # named if used
        return " * ".join(f"{self.prefix}{d}" for d in used), \
            " * ".join(str(getattr(self, d)) for d in used)

    def resolve(self, world_size: int) -> ParallelDims:
        """A copy with ``dp_shard`` filled in from ``world_size``; a ValueError (saying
        what to change) if the degrees cannot multiply to it."""
        rest = self.pp * self.dp_replicate * self.cp * self.tp
        dp_shard = self.dp_shard
        if dp_shard == -1:
            if world_size % rest:
                names, values = self._names("pp", "dp_replicate", "cp", "tp")
                raise ValueError(f"world size {world_size} is not divisible by {names} = "
                                 f"{values} = {rest}; change those sizes or the number of "
                                 f"processes")
            dp_shard = world_size // rest
        if rest * dp_shard != world_size:
            names, values = self._names("pp", "dp_replicate", "dp_shard", "cp", "tp")
            raise ValueError(f"{names} = {values} = {rest * dp_shard}, but the world size is "
                             f"{world_size}; set {self.prefix}dp_shard = -1 to use the rest, or "
                             f"change the sizes")
        return dataclasses.replace(self, dp_shard=dp_shard)

    def check_mode(self, mode: str) -> None:
        """Raise a ValueError if data-parallel ``mode`` cannot run on these degrees:
        ``fully_shard`` shards over ``dp_shard`` alone (``dp_replicate`` must be 1),
        ``replicate`` replicates over ``dp_replicate`` alone (``dp_shard`` must be 1; not
        checked while it is still -1), ``hybrid_shard`` uses both. The mode is named
        ``{prefix}dp_mode``, or ``mode`` without a prefix."""
        p, key = self.prefix, f"{self.prefix}dp_mode" if self.prefix else "mode"
        if mode == "fully_shard" and self.dp_replicate > 1:
            raise ValueError(f"{key}='fully_shard' shards over {p}dp_shard only, but "
                             f"{p}dp_replicate = {self.dp_replicate}; use {key}='hybrid_shard' "
                             f"or set {p}dp_replicate = 1")
        if mode == "replicate" and self.dp_shard > 1:
            raise ValueError(f"{key}='replicate' replicates over {p}dp_replicate only, but "
                             f"{p}dp_shard = {self.dp_shard}; set {p}dp_shard = 1 and "
                             f"{p}dp_replicate = {self.dp_replicate * self.dp_shard}, or use "
                             f"{key}='fully_shard' / 'hybrid_shard'")

    # ----------------------------------------------------------------- derived degrees
    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self._shard() * self.cp * self.tp

    @property
    def dp(self) -> int:
        """Data-parallel ranks (slices of the global batch): ``dp_replicate * dp_shard``."""
        return self.dp_replicate * self._shard()

    @property
    def dp_shard_cp(self) -> int:
        """Ranks a parameter is sharded over: ``dp_shard * cp``."""
        return self._shard() * self.cp

    @property
    def expert_ranks(self) -> int:
        """Ranks of one data-parallel replica that hold the same non-expert weights and
        read different tokens for the experts: ``dp_shard * cp * tp``. TP ranks count: under
        TP each routes its own part of the sequence (``parallel/expert.py``), so for the
        experts they are data-parallel ranks; the ``ep`` groups and the experts' sharding
        are carved out of these (:meth:`expert_mesh`)."""
        return self._shard() * self.cp * self.tp

    def sequence_part(self, seq_len: int) -> int:
        """Positions of each sequence in one rank's activations between blocks: its
        context-parallel part, sequence-sharded over TP (TP + SP)."""
        return seq_len // (self.cp * self.tp)

    def expert_shard(self, mode: str = "fully_shard", etp: int = 1) -> int:
        """Ranks one expert-parallel rank's experts are sharded over (the experts' mesh's
        ``dp_shard``, :meth:`expert_mesh`): ``expert_ranks / ep``, or 1 where the experts
        are replicated (``mode = "replicate"``, or ``expert_ranks = 1``: the ``ep`` groups
        come out of ``dp_replicate``). ``etp > 1``: the TP ranks are the experts' own
        ``tp`` dim, so the ranks are ``dp_shard x cp`` (:meth:`etp_expert_ranks`)."""
        ranks = self.expert_ranks if etp == 1 else self._shard() * self.cp
        if mode == "replicate" or ranks == 1:
            return 1
        return ranks // self.ep

    def etp_expert_ranks(self, mode: str = "fully_shard") -> tuple[int, str]:
        """Under expert tensor parallelism (:meth:`expert_mesh` with ``etp``): the ranks the
        ``ep`` groups come out of, ``dp_shard x cp`` (TP peers hold the same experts), or
        with ``dp_replicate`` where the experts are replicated or those are 1; and their
        keys as the caller spells them (``{prefix}dp_shard * ...``)."""
        ranks = self._shard() * self.cp
        names = ["dp_shard", *(d for d in CP_DIMS if getattr(self, d) > 1)]
        if mode == "replicate" or ranks == 1:
            ranks, names = ranks * self.dp_replicate, ["dp_replicate", *names]
        return ranks, " * ".join(f"{self.prefix}{d}" for d in names)

    def _expert_names(self) -> str:
        """``expert_ranks``' factors as the caller spells them (the cp dims and tp when used)."""
        used = ["dp_shard"] + [d for d in (*CP_DIMS, "tp") if getattr(self, d) > 1]
        return " * ".join(f"{self.prefix}{d}" for d in used)

    def _shard(self) -> int:
        if not self.resolved:
            raise ValueError("dp_shard = -1 is not resolved yet: call resolve(world_size)")
        return self.dp_shard

    @property
    def sizes(self) -> dict[str, int]:
        """The built mesh's ``{dim: size}``, outermost dim first (see ``MESH_DIMS``)."""
        return {d: getattr(self, d) if d != "dp_shard" else self._shard() for d in MESH_DIMS}

    def stride(self, dim: str) -> int:
        """How many ranks apart neighbours in ``dim``'s groups are: the mesh lays ranks
        out row-major, so the product of the sizes of the dims inside ``dim``. ``"ep"``:
        1, the experts' mesh puts ``ep`` innermost over the flattened ranks below
        ``dp_shard`` (or ``dp_replicate``), consecutive in the job mesh (:meth:`expert_mesh`:
        with TP, an EP group takes the TP ranks first)."""
        if dim == "ep":
            return 1
        sizes, stride = self.sizes, 1
        for d in reversed(MESH_DIMS):
            if d == dim:
                return stride
            stride *= sizes[d]
        raise ValueError(f"{dim!r} is not a mesh dim; the mesh has {MESH_DIMS}")

    def coords(self, rank: int) -> Coords:
        """``rank``'s coordinates (ranks are laid out row-major over ``MESH_DIMS``)."""
        sizes, at = self.sizes, {}
        for d in reversed(MESH_DIMS):
            rank, at[d] = divmod(rank, sizes[d])
        return Coords(at["pp"], at["dp_replicate"], at["dp_shard"], at["tp"], self.pp,
                      at["dp_replicate"] * sizes["dp_shard"] + at["dp_shard"], self.dp,
                      at["cp_ring"], at["cp_ulysses"])

    def check_cp(self, seq_len: int, n_heads: int, seq_key: str = "seq_len",
                 heads_key: str = "n_heads") -> None:
        """Raise a ValueError unless context parallelism can split this model and sequence:
        the sequence into ``2 * cp_ring`` head-tail chunks, each ring rank's part into
        ``cp_ulysses`` pieces; the query heads (per TP rank) over ``cp_ulysses``. Key/value
        heads need not divide: Ulysses repeats them to a count that does."""
        if self.cp == 1:
            return
        p, parts = self.prefix, 2 * self.cp
        if seq_len % parts:
            raise ValueError(f"{seq_key} = {seq_len} is not divisible by 2 * {p}cp_ring * "
                             f"{p}cp_ulysses = {parts} (each ring rank holds two chunks of "
                             f"the sequence, split again over Ulysses); change one of them")
        if (seq_len // self.cp) % self.tp:
            raise ValueError(f"{seq_key} = {seq_len} over {p}cp_ring * {p}cp_ulysses = "
                             f"{self.cp} ranks leaves {seq_len // self.cp} tokens, not divisible "
                             f"by {p}tp = {self.tp} (sequence parallel splits them again)")
        heads = self.tp * self.cp_ulysses
        if n_heads % heads:
            names = f"{p}tp * {p}cp_ulysses" if self.tp > 1 else f"{p}cp_ulysses"
            raise ValueError(f"{heads_key} = {n_heads} is not divisible by {names} = {heads} "
                             f"(Ulysses gives each rank a share of the attention heads); "
                             f"change one of them")

    # ----------------------------------------------------------------- meshes
    def build_mesh(self, device_type: str = "cpu", fake: bool = False) -> DeviceMesh:
        """The mesh over all ranks, dims ``MESH_DIMS``. The process group must exist
        (``torchrun`` + ``dist.init_process_group``), with ``world_size`` ranks.
        ``fake``: a mesh over a fake process group's world (the planner's traces)."""
        shape = tuple(self.sizes.values())
        ranks = torch.arange(self.world_size).view(shape)
        if fake:
            return DeviceMesh(device_type, ranks, mesh_dim_names=MESH_DIMS)
        if dist.is_initialized() and dist.get_world_size() != self.world_size:
            raise ValueError(f"the mesh needs {self.world_size} ranks, the process group "
                             f"has {dist.get_world_size()}")
        return shared_mesh(device_type, ranks, MESH_DIMS)

    @staticmethod
    def data_parallel_mesh(mesh: DeviceMesh, mode: str) -> DeviceMesh:
        """The sub-mesh ``mode`` runs on: ``dp_shard`` for fully_shard, ``dp_replicate`` for
        replicate, both for hybrid_shard. Context-parallel ranks hold the same weights, so
        with ``cp > 1`` they join the data-parallel dim: parameters are sharded over
        ``dp_shard x cp`` (a flattened dim ``dp_shard_cp``), or replicated over
        ``dp_replicate x cp`` (``dp_replicate_cp``), and gradients reduced over the same.
        A mesh without our dim names is used as given."""
        names = mesh.mesh_dim_names or ()
        if not {"dp_replicate", "dp_shard"} <= set(names):
            return mesh
        dims = ParallelDims(dp_replicate=mesh["dp_replicate"].size(),
                            dp_shard=mesh["dp_shard"].size())
        dims.check_mode(mode)
        cp = tuple(d for d in CP_DIMS if d in names and mesh[d].size() > 1)
        inner = "dp_replicate" if mode == "replicate" else "dp_shard"
        if not cp:
            return mesh["dp_replicate", inner] if mode == "hybrid_shard" else mesh[inner]
        flat = flatten_mesh(mesh[(inner, *cp)], f"{inner}_cp")
        if mode == "hybrid_shard":
            return slice_flattened(mesh, ("dp_replicate", flat.mesh_dim_names[0]))
        return flat

    @staticmethod
    def expert_mesh(mesh: DeviceMesh, ep: int, mode: str = "fully_shard",
                    etp: int = 1) -> DeviceMesh:
        """The experts' mesh over the job ``mesh``'s ranks (dims ``MESH_DIMS``, as
        :meth:`build_mesh` makes them), dims ``EXPERT_MESH_DIMS``: ``dp_shard x cp_ring x
        cp_ulysses x tp`` (:attr:`expert_ranks`: one replica's ranks that feed the experts
        different tokens) flattened and split into ``(expert_ranks / ep, ep)``, ``ep``
        inside so that neighbouring ranks exchange tokens: with TP, the ``ep`` groups take
        the TP ranks first (TP's fast links carry the all-to-all). The experts' ``dp_shard``
        then counts the ranks holding the *same* experts, over which ``data_parallel``
        shards them and sums their gradients (TP ranks included: torchtitan's experts'
        mesh, ``dp_shard * cp * tp / ep``); the experts' cp and tp dims are left of size 1
        (the experts are neither context- nor tensor-parallel). ``mode = "replicate"`` (the
        experts replicated, reduced over ``dp_replicate``), or ``expert_ranks = 1``: the
        groups come out of all of a stage's ranks, the experts' ``dp_replicate`` holding the
        rest. ``etp`` (expert tensor parallelism, ``parallel/expert_tensor.py``): above 1,
        ``tp`` is left out of the flattened ranks and stays the experts' ``tp`` dim (each
        expert's width is split over it), so the ``ep`` groups and the experts' data
        parallel come out of ``dp_shard x cp`` (or with ``dp_replicate``, as above)."""
        names = tuple(mesh.mesh_dim_names or ())
        if names != MESH_DIMS:
            raise ValueError(f"expert_mesh needs the job mesh (dims {', '.join(MESH_DIMS)}, "
                             f"as simplefsdp.make_mesh builds it), got dims {names}")
        inner = MESH_DIMS[MESH_DIMS.index("dp_shard"):]  # dp_shard, cp_ring, cp_ulysses, tp
        if etp > 1:  # the experts keep their own tp dim
            inner = inner[:-1]
        used = [d for d in inner if d == "dp_shard" or mesh[d].size() > 1]
        shard = 1
        for d in inner:
            shard *= mesh[d].size()
        if mode == "replicate" or shard == 1:  # (pp, R, 1, CR, CU, T) -> (pp, R*../ep, 1, ep)
            at, used = MESH_DIMS.index("dp_replicate"), ["dp_replicate", *used[1:]]
            if shard == 1:
                used = ["dp_replicate"]
        else:  # (pp, R, S, CR, CU, T) -> (pp, R, S * CR * CU * T / ep, ep, 1, 1, 1)
            at = MESH_DIMS.index("dp_shard")
        last = MESH_DIMS.index(inner[-1])
        ranks = mesh.mesh.flatten(at, last)
        ParallelDims.check_ep(ep, ranks.shape[at], " * ".join(used),
                              "the expert-parallel groups are carved out of those ranks")
        tail = (1, ep, 1, 1, 1) if at == MESH_DIMS.index("dp_replicate") else (ep, 1, 1, 1)
        if etp > 1:  # the job's tp dim follows, unflattened
            tail = tail[:-1]
        ranks = ranks.unflatten(at, (ranks.shape[at] // ep, *tail))
        return shared_mesh(mesh.device_type, ranks, EXPERT_MESH_DIMS)

    @staticmethod
    def check_ep(ep: int, ranks: int, names: str, why: str, prefix: str = "") -> None:
        """The expert-parallel rule, its one statement: a ValueError unless ``ep`` divides
        the ``ranks`` its groups are carved out of. ``names``: those ranks' sizes as the
        caller spells them; ``why``: which ranks they are. Checked on the sizes
        (construction) and on a built mesh (:meth:`expert_mesh`)."""
        if ranks % ep:
            raise ValueError(f"{prefix}ep = {ep} must divide {names} = {ranks} ({why})")

    @staticmethod
    def local_rank(mesh: DeviceMesh, dim: int | str | None = None) -> int:
        """This rank's coordinate along ``dim`` (a name or an index) of ``mesh``; a 1-D mesh
        needs no ``dim``. E.g. its pipeline stage along ``"pp"``."""
        return mesh.get_local_rank(dim)

    @staticmethod
    def coordinate(mesh: DeviceMesh) -> list[int] | None:
        """This rank's coordinates in ``mesh``, one per dim (None if not in it)."""
        return mesh.get_coordinate()

    @classmethod
    def layouts(cls, world_size: int, cp: bool = False) -> Iterator[ParallelDims]:
        """Every resolved way to lay ``world_size`` ranks out as ``tp x pp x dp_replicate x
        dp_shard`` (ep = 1), ordered by ``tp``, then ``pp``, then ``dp_replicate``, each
        ascending (the planner's search filters these). ``cp``: the sharded ranks are also
        split as ``dp_shard x cp_ring x cp_ulysses`` every way they divide (ascending
        ``cp``, then ``cp_ulysses``); without it cp_ring = cp_ulysses = 1."""
        for tp in _divisors(world_size):
            for pp in _divisors(world_size // tp):
                dp = world_size // (tp * pp)
                for rep in _divisors(dp):
                    for c in _divisors(dp // rep) if cp else [1]:
                        for uly in _divisors(c):
                            yield cls(pp=pp, dp_replicate=rep, dp_shard=dp // rep // c, tp=tp,
                                      cp_ring=c // uly, cp_ulysses=uly)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def make_mesh(dp_shard: int = -1, dp_replicate: int = 1, tp: int = 1, pp: int = 1,
              device_type: str = "cpu", cp_ring: int = 1, cp_ulysses: int = 1) -> DeviceMesh:
    """Build the ``MESH_DIMS`` mesh over all ranks (dims of size 1 included).

    ``dp_shard=-1`` takes whatever the other sizes leave of the world size (see
    ``ParallelDims.resolve``). The process group must already be initialized
    (``torchrun`` + ``dist.init_process_group``).
    """
    if not dist.is_initialized():
        raise RuntimeError("make_mesh needs an initialized process group: call "
                           "torch.distributed.init_process_group first (torchrun sets it up)")
    if device_type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("make_mesh(device_type='cuda'), but CUDA is not available here "
                           "(no GPU, or a CPU-only torch build); use device_type='cpu'")
    dims = ParallelDims(pp=pp, dp_replicate=dp_replicate, dp_shard=dp_shard, tp=tp,
                        cp_ring=cp_ring, cp_ulysses=cp_ulysses)
    return dims.resolve(dist.get_world_size()).build_mesh(device_type)


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (``to_local()``); a plain tensor as it is. The one
    helper for code that works on sharded and unsharded tensors alike."""
    return t.to_local() if isinstance(t, DTensor) else t


def copy_into_shard(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy ``full`` (the whole tensor, the same on every rank) into ``param``: this rank's
    piece of it for a DTensor, all of it for a plain tensor. Nothing is communicated."""
    if isinstance(param, DTensor):
        full = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
    local_shard(param).copy_(local_shard(full))


def dim0_rows(rows: int, parts: int, index: int) -> tuple[int, int]:
    """Rows ``[start, stop)`` of piece ``index`` when ``rows`` rows are split on dim 0 into
    ``parts`` as ``Shard(0)`` splits them: ``torch.chunk`` pieces of ``ceil(rows / parts)``
    rows, then empty ones for the ranks it left out (3 rows over 2: 2 + 1; 1 over 2: 1 + 0;
    5 over 4: 2 + 2 + 1 + 0). The one owner of this arithmetic (sharding, weight loading,
    the float8 gather's padding)."""
    chunk = -(-rows // parts)
    start = min(index * chunk, rows)
    return start, min(start + chunk, rows)


def dim0_chunk(tensor: torch.Tensor, parts: int, index: int) -> torch.Tensor:
    """Rank ``index``'s piece of ``tensor`` split on dim 0 into ``parts`` (:func:`dim0_rows`)."""
    start, stop = dim0_rows(tensor.shape[0], parts, index)
    return tensor.narrow(0, start, stop - start)


def pad_dim0(t: torch.Tensor, rows: int) -> torch.Tensor:
    """``t`` with zero rows appended up to ``rows`` on dim 0 (a piece padded to the
    collectives' even size, as ``Shard(0)`` pads an uneven split)."""
    if t.shape[0] == rows:
        return t
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])
