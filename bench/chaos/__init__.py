"""The seeded chaos run (`python -m bench.chaos`, run.py): its Redis (redis_nodes.py), fault
schedule (schedule.py; across hosts the network's, network.py), fault injector (faults.py),
load (load.py), recorded history (history.py) and the checker that reads the history back
(checker.py, also `python -m bench.chaos.checker <history>`). docs/chaos.md tells the run."""
