"""The data doctor: a whole data set checked before a run (doctor.py, docs/doctor.md).

It builds the data through the training builders (engine.build.build_data) under
datasets.base.collecting_problems, so the loaders' own record checks list every problem instead of
stopping at the first, then streams every sample through the loaders' readers in worker processes:
  sources.py    per loader: the samples, the check of one sample (decode, sizes, PNG ids, mask
                values, audio), what it adds to the statistics and the hashes
  findings.py   one finding: check, severity, file, record, message
  stats.py      counts per class and split, sizes, lengths, durations, imbalance; plots
  leaks.py      exact and near duplicates within and across splits
  labels.py     likely label errors (cleanlab, K-fold out-of-sample probabilities of a cheap model)
  clean.py      --write-clean: a filtered copy of the annotations, the user's files untouched
  run.py        all of it, and report.json / report.md
engine/ never imports this package.
"""
