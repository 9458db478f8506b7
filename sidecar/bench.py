"""Benchmark (filled in below)."""
from __future__ import annotations
import argparse
def add_arguments(p: argparse.ArgumentParser) -> None:
    pass
def run(args: argparse.Namespace) -> int:
    return 1
