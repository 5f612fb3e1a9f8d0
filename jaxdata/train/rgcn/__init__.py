"""Mini-batch RGCN entity classification (`minibatch`); the rest trains in
`jaxdata.train.attention`."""
