"""Graphs and datasets on the host: heterogeneous graphs, RDF benchmarks, synthetic graphs.

Everything here is NumPy on the host; models move what they need to the device.

    >>> from jaxdata.data import HeteroGraph, load_entities, synthetic_entities
    >>> g = HeteroGraph.from_edges([0, 1], [1, 2], [0, 1], add_inverse=True)
    >>> ds = load_entities("aifb.tgz")             # the RGCN paper's AIFB benchmark
    >>> big = synthetic_entities(num_nodes=200_000, num_edges=2_000_000, num_relations=500)
    >>> papers = powerlaw_graph(num_nodes=10_000_000, num_edges=200_000_000, feature_dim=256)
"""

from jaxdata.data.dataset import EntityDataset
from jaxdata.data.graph import HeteroGraph
from jaxdata.data.mag import MagDataset, synthetic_mag
from jaxdata.data.powerlaw import NodeDataset, powerlaw_graph
from jaxdata.data.rdf import load_entities
from jaxdata.data.synthetic import synthetic_entities

__all__ = [
  "HeteroGraph",
  "EntityDataset",
  "load_entities",
  "synthetic_entities",
  "NodeDataset",
  "powerlaw_graph",
  "MagDataset",
  "synthetic_mag",
]
