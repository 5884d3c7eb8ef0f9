"""The bodies of the command lines: what benchmark.py, export.py, evaluate.py, quantize.py and
doctor.py do once their arguments are parsed, and the helpers the command lines share (commands.cli:
the checkpoint options and the one `error: ...` exit). Only this package prints; the libraries below
it (engine/, models/, datasets/, recipes/, artifacts/, exporters/) return values and log. The root
scripts are thin entry points that parse arguments and call commands.<name>.main.
"""
