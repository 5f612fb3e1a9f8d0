"""Graphs and datasets on the host: heterogeneous graphs, RDF benchmarks, synthetic graphs.

Everything here is NumPy on the host; models move what they need to the device.

    >>> from jaxdata.data import HeteroData, HeteroGraph, load_entities, read, synthetic_entities
    >>> data = read("ogbn_mag/")                   # OGB's raw layout, or a folder of edge lists
    >>> g = HeteroGraph.from_edges([0, 1], [1, 2], [0, 1], add_inverse=True)
    >>> ds = load_entities("aifb.tgz")             # the RGCN paper's AIFB benchmark
    >>> big = synthetic_entities(num_nodes=200_000, num_edges=2_000_000, num_relations=500)
    >>> papers = powerlaw_graph(num_nodes=10_000_000, num_edges=200_000_000, feature_dim=256)
"""

from jaxdata.data.dataset import EntityDataset
from jaxdata.data.graph import HeteroGraph
from jaxdata.data.hetero import HeteroData
from jaxdata.data.mag import MagDataset, synthetic_mag
from jaxdata.data.powerlaw import NodeDataset, powerlaw_graph
from jaxdata.data.rdf import load_entities
from jaxdata.data.readers import read, read_edge_lists, read_ogb
from jaxdata.data.synthetic import synthetic_entities

__all__ = [
  "HeteroData",
  "read",
  "read_ogb",
  "read_edge_lists",
  "HeteroGraph",
  "EntityDataset",
  "load_entities",
  "synthetic_entities",
  "NodeDataset",
  "powerlaw_graph",
  "MagDataset",
  "synthetic_mag",
]
