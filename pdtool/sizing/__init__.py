"""`pdtool size`'s model: predicted TTFT, TPOT and goodput of candidate deployments (model.py),
the deployments weighed (search.py), the constants per GPU kind (hardware.py,
conf/sizing/hardware.yaml) and their fit to measurements (calibrate.py). Pure: configs, plans
and arithmetic, no launch or engine code. docs/sizing.md."""
