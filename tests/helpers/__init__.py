"""What the tests share and start, not tests themselves: scenarios run both on the simulator and on real backends
(``*_scenarios``), worker scripts that real processes run (``*_worker``), and the launchers that start them
(``launch``, ``failure_launch``). Worker scripts import ``helpers.<module>``: the launchers put ``tests/`` on their
``PYTHONPATH``, as pytest puts it on ``sys.path`` for the tests.
"""
