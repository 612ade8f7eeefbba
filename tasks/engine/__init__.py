"""The engine every stage runs on: the config vocabulary and step versions, the Prefect cache
policy and locks, the runner of one step, the scheduler of many, the artefact store, lineage,
shard parallelism and the machine's shared local Ray.

It imports no stage, no `training/` and no `evaluation/` code (tests/test_foundation.py checks):
stage modules (`tasks/<stage>.py`) sit beside this folder, one per stage, with the libraries the
data stages share (`tasks/documents.py`, `tasks/judging.py`).
"""
