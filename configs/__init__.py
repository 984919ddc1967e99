"""Example manifests (the quickstart among them), installed as package data of ``pbt.configs``."""
