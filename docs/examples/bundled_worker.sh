# The bundled worker from a checkout (the "Your training code" page), with the digits set at
# ./checkpoints/digits.npz; tests/worker/test_readme_example.py runs this command line.
# [START howto_bundled_worker]
python -m gpu_resilience_trainer train --checkpoint-dir ./checkpoints --data digits.npz --steps 40 --checkpoint-every 10
# [END howto_bundled_worker]
