"""Serving tools: the P/D proxy, the process launcher, the demo, the chaos soak, the tiny model."""
