"""One module per method (and the baselines they are compared against). Each composes the sites layer,
the modules in `mlpsurgery.modules` and the shared loops in `train.py` / `capture.py`."""
