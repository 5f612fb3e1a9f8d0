"""Reference formulations: the plain-JAX (and PyTorch Geometric) versions of the layers jaxdata
compiles, written for clarity, not speed. Tests use them as ground truth and `jaxdata bench`
times them as peers (PyG keeps `torch_geometric.testing` in the same spirit).

  jaxdata.reference.rgcn       one RGCN layer: transform-all-then-gather, ragged_dot, per-edge
                               weights, featureless; PyG's RGCNConv from the same weights
  jaxdata.reference.attention  one RGAT and one HGT layer, three formulations each; PyG's
                               RGATConv and HGTConv from the same weights
"""
