"""What the tests share: config composition (`pdtool_cfg`), checkpoints and their oracle
(`hf_checkpoints`), real SGLang servers (`sglang_servers`), SGLang's transfer classes built the
way SGLang builds them (`sglang_pair`), a Slurm cluster on this machine (`slurm_cluster`), the
local launcher driven as a user drives it (`local_launch`), reference deployments from RankSpecs
(`reference_served`), signed control-plane bodies (`wire_bodies`), and the interpreter
stand-ins the launch tests run (`argv_dump.py`, `step_probe.py`). Test modules import from here,
never from one another (tests/test_layers.py checks it)."""
