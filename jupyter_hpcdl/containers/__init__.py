"""Containers run by udocker: image catalogue, per-user containers, run command lines, process control."""
