"""The engine every stage runs on: steps and their versions, the Prefect cache policy and locks,
the runner of one step, the scheduler of many, the artefact store, lineage, shard parallelism,
document shards and the shared machinery of filter-type stages.

Stage modules (`tasks/<stage>.py`) sit beside this folder, one per stage.
"""
