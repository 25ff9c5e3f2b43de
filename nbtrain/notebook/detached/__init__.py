"""Runs that outlive the kernel: submit, its supervisor, Run/attach/runs read back, export."""
