"""Synthetic heterogeneous node-classification datasets shaped like IGB-Heterogeneous and ogbn-mag, scaled down.

``igbh-tiny`` / ``igbh-small``: paper, author, institute, fos (field of study) in the proportions of
IGBH's published node and edge counts, cut to a few hundred thousand nodes, 1024-dim float32
features on every type (IGBH's), 19 paper classes; relations cites, written_by, affiliated_to, topic
and their reverses (so that messages reach papers from every type, as MLPerf's R-GAT does).
``mag``: ogbn-mag's types (paper, author, institution, field_of_study) and relations in its
proportions, 128-dim features on papers only, 349 -> 64 classes.

Every node has a latent class; an edge joins nodes of one class with probability ``homophily``
(else a random one), sources are drawn power-law within the class (a few hubs, a long tail), and
features are a class centroid (per type) plus noise, weak on papers: the labels are learnable,
better with the neighbours than without.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from datapath.graph._files import atomic_directory, check_free_space, disk_full, load_npy, save_json, save_npy
from datapath.graph.errors import DatasetError
from datapath.graph.hetero import EdgeType, HeteroGraph
from datapath.memory import host_of

_NPY_HEADER = 128  # bytes of a .npy header (numpy pads it to a multiple of 64)


@dataclass(frozen=True)
class HeteroSpec:
    """Node counts, relations with edge counts, feature widths per type, classes of the target type."""

    name: str
    num_nodes: dict[str, int]
    edges: dict[EdgeType, int]
    features: dict[str, int]
    num_classes: int
    target: str = "paper"
    reverse: tuple[str, ...] = ()
    homophily: float = 0.75
    alpha: float = 2.0
    signal: dict[str, float] = field(default_factory=dict)
    train_frac: float = 0.6
    val_frac: float = 0.2


def _igbh(name: str, scale: float) -> HeteroSpec:
    # IGBH-small's published counts (papers 1M, authors 1.93M, institutes 14.8K, fos 190K; cites 12.1M,
    # written_by 4.55M, affiliated_to 3.57M, topic 7.82M) times ``scale``
    n = {"paper": 1_000_000, "author": 1_926_066, "institute": 14_751, "fos": 190_449}
    e = {("paper", "cites", "paper"): 12_070_502, ("paper", "written_by", "author"): 4_553_516,
         ("author", "affiliated_to", "institute"): 3_568_564, ("paper", "topic", "fos"): 7_818_099}
    return HeteroSpec(name, {t: max(8, int(c * scale)) for t, c in n.items()},
                      {et: max(16, int(c * scale)) for et, c in e.items()}, {t: 1024 for t in n}, 19,
                      reverse=("written_by", "affiliated_to", "topic"),
                      signal={"paper": 0.03, "author": 0.05, "institute": 0.08, "fos": 0.08})


def _mag(name: str, scale: float) -> HeteroSpec:
    n = {"paper": 736_389, "author": 1_134_649, "institution": 8_740, "field_of_study": 59_965}
    e = {("author", "affiliated_with", "institution"): 1_043_998, ("author", "writes", "paper"): 7_145_660,
         ("paper", "cites", "paper"): 5_416_271, ("paper", "has_topic", "field_of_study"): 7_505_078}
    return HeteroSpec(name, {t: max(8, int(c * scale)) for t, c in n.items()},
                      {et: max(16, int(c * scale)) for et, c in e.items()}, {"paper": 128}, 64,
                      reverse=("writes", "affiliated_with", "has_topic"), signal={"paper": 0.1})


HETERO_PRESETS: dict[str, HeteroSpec] = {
    "igbh-tiny": _igbh("igbh-tiny", 0.01),     # 10K papers, ~31K nodes, 1024-dim: ~128 MB of features
    "igbh-small": _igbh("igbh-small", 0.1),    # 100K papers, ~313K nodes: ~1.3 GB of features
    "mag": _mag("mag", 0.05),                  # 37K papers, ~97K nodes, 128-dim paper features
}


@dataclass
class HeteroData:
    """A generated dataset: the graph, per-type features, the target type's labels and splits (all CPU or device)."""

    name: str
    graph: HeteroGraph
    features: dict[str, torch.Tensor]
    labels: torch.Tensor
    target: str
    train_idx: torch.Tensor
    val_idx: torch.Tensor
    test_idx: torch.Tensor
    num_classes: int

    @property
    def feature_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.features.values())

    def save(self, directory: str | Path, *, overwrite: bool = False) -> Path:
        """Write the dataset into ``directory``: ``graph/`` (`HeteroGraph.save`), ``features_<type>.npy``,
        ``labels.npy``, ``{train,val,test}_idx.npy`` and ``meta.json`` (``"kind": "hetero"``), all at once.

        The files are written into a temporary sibling of ``directory``, fsynced, and swapped into place
        (as `datapath.graph.Dataset.save`): an interrupted save (an error, a full disk, Ctrl-C) leaves what
        was there before and no half dataset.  A non-empty ``directory`` is replaced only with
        ``overwrite=True``.  A full disk raises `DiskFullError` naming the directory and the bytes needed.
        """
        target = Path(directory)
        arrays = [*self.features.values(), self.labels, self.train_idx, self.val_idx, self.test_idx]
        arrays += [a for g in self.graph.relations.values() for a in (g.indptr, g.indices, g.edge_ids) if a is not None]
        needed = sum(a.numel() * a.element_size() + _NPY_HEADER for a in arrays) + _NPY_HEADER
        with atomic_directory(target, overwrite, "heterogeneous dataset") as tmp:
            try:
                check_free_space(target.absolute().parent, needed, "heterogeneous dataset")
                (tmp / "graph").mkdir()
                self.graph.write_into(tmp / "graph")
                for t, x in self.features.items():
                    save_npy(tmp / f"features_{t}.npy", host_of(x).cpu().numpy())
                for name in ("labels", "train_idx", "val_idx", "test_idx"):
                    save_npy(tmp / f"{name}.npy", host_of(getattr(self, name)).cpu().numpy())
                meta = {"kind": "hetero", "name": self.name, "target": self.target, "num_classes": self.num_classes,
                        "num_nodes": self.graph.num_nodes, "num_edges": sum(self.graph.num_edges.values()),
                        "features": {t: list(x.shape) for t, x in self.features.items()}}
                save_json(tmp / "meta.json", meta)  # last: a directory with it is complete
            except OSError as exc:  # named by the target's path, not its temporary sibling's
                if exc.filename is not None:
                    exc.filename = str(exc.filename).replace(str(tmp), str(target.absolute()))
                full = disk_full(exc, target.absolute().parent, needed, "heterogeneous dataset")
                if full is None:
                    raise
                raise full from None
        return target

    @classmethod
    def load(cls, directory: str | Path, *, mmap: bool = True) -> "HeteroData":
        """Load a dataset written by `save` (arrays memory-mapped by default)."""
        d = Path(directory)
        meta = json.loads((d / "meta.json").read_text())
        if meta.get("kind") != "hetero":
            raise DatasetError(f"{d} is not a heterogeneous dataset (meta.json has no kind 'hetero')")
        arr = {name: torch.as_tensor(load_npy(d / f"{name}.npy", mmap))
               for name in ("labels", "train_idx", "val_idx", "test_idx")}
        feats = {t: torch.as_tensor(load_npy(d / f"features_{t}.npy", mmap)) for t in meta["features"]}
        return cls(meta["name"], HeteroGraph.load(d / "graph", mmap=mmap), feats, arr["labels"], meta["target"],
                   arr["train_idx"], arr["val_idx"], arr["test_idx"], int(meta["num_classes"]))


def is_hetero_dataset(directory: str | Path) -> bool:
    """Whether ``directory`` holds a dataset written by `HeteroData.save`."""
    p = Path(directory) / "meta.json"
    try:
        return p.is_file() and json.loads(p.read_text()).get("kind") == "hetero"
    except ValueError:
        return False


def generate_hetero(spec: HeteroSpec | str, *, seed: int = 0, device: str | torch.device = "cpu") -> HeteroData:
    """Generate ``spec`` (a `HeteroSpec` or a preset name) on ``device``; the result is on the CPU."""
    if isinstance(spec, str):
        if spec not in HETERO_PRESETS:
            raise ValueError(f"unknown heterogeneous preset {spec!r}; choose from {sorted(HETERO_PRESETS)}")
        spec = HETERO_PRESETS[spec]
    dev = torch.device(device)
    g = torch.Generator(device=dev).manual_seed(seed)
    c = spec.num_classes
    perm, klass = {}, {}
    for t, n in spec.num_nodes.items():  # class of node v: its position in a random permutation, cut in C blocks
        perm[t] = torch.randperm(n, generator=g, device=dev)
        pos = torch.empty(n, dtype=torch.int64, device=dev)
        pos[perm[t]] = torch.arange(n, device=dev)
        klass[t] = pos * c // n

    def pick(t: str, cls: torch.Tensor) -> torch.Tensor:
        """Power-law draw among the nodes of type ``t`` in class ``cls`` (per entry)."""
        n = spec.num_nodes[t]
        lo = (cls * n + c - 1) // c
        hi = ((cls + 1) * n + c - 1) // c
        u = torch.rand(cls.numel(), generator=g, device=dev) ** spec.alpha
        return perm[t][(lo + (u * (hi - lo)).long()).clamp(max=n - 1)]

    rels: dict[EdgeType, torch.Tensor] = {}
    for (s, name, d), m in spec.edges.items():
        dst = torch.randint(0, spec.num_nodes[d], (m,), generator=g, device=dev)
        same = torch.rand(m, generator=g, device=dev) < spec.homophily
        cls = torch.where(same, klass[d][dst], torch.randint(0, c, (m,), generator=g, device=dev))
        src = pick(s, cls)
        key = torch.unique(src * spec.num_nodes[d] + dst)  # no parallel edges
        ei = torch.stack([key // spec.num_nodes[d], key % spec.num_nodes[d]])
        rels[(s, name, d)] = ei
        if name in spec.reverse:
            rels[(d, f"rev_{name}", s)] = ei.flip(0)
    rels = {et: ei.cpu() for et, ei in rels.items()}
    feats = {}
    for t, width in spec.features.items():
        centroid = torch.randn(c, width, generator=g, device=dev)
        x = torch.randn(spec.num_nodes[t], width, generator=g, device=dev)
        x.add_(centroid[klass[t]], alpha=spec.signal.get(t, 0.05))
        feats[t] = x.cpu()
    n_t = spec.num_nodes[spec.target]
    order = torch.randperm(n_t, generator=torch.Generator().manual_seed(seed + 1))
    a, b = int(spec.train_frac * n_t), int((spec.train_frac + spec.val_frac) * n_t)
    graph = HeteroGraph(spec.num_nodes, rels, validate=False)
    return HeteroData(spec.name, graph, feats, klass[spec.target].cpu(), spec.target, order[:a].sort().values,
                      order[a:b].sort().values, order[b:].sort().values, c)
