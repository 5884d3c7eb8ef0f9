"""tune.py's parts: the search space over config keys (space), the study and its storage (study), one
trial as a train.py process watched by its pruner (trial) and the study's report (report). The search
itself is Optuna's: its samplers, pruners, storages and plots."""
