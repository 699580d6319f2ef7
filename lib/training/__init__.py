"""Training's machinery, which every script shares: flags and presets (configurator.py), the device
and precision (hardware.py), the data (data.py), the recipe (recipe.py), the optimiser (muon.py),
parallelism from outside the model (parallel.py) and the files a run writes (checkpoint.py)."""
