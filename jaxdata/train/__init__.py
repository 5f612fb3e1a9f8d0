"""Training loops behind `jaxdata train ...`."""
