"""Reference formulations: the plain-JAX (and PyTorch Geometric) versions of the layers jaxdata
compiles, written for clarity, not speed. Tests use them as ground truth and the benchmarks
time them as peers (PyG keeps `torch_geometric.testing` in the same spirit).

  jaxdata.reference.rgcn       one RGCN layer: transform-all-then-gather, ragged_dot, per-edge
                               weights, featureless
  jaxdata.reference.attention  one RGAT and one HGT layer, three formulations each
  jaxdata.reference.pyg        PyG's RGCNConv, RGATConv and HGTConv from the same weights (needs
                               torch and torch_geometric)
"""
