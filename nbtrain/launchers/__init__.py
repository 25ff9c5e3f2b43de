"""One module per way of starting ranks; all share `base.ProcessLauncher` or its interface."""
