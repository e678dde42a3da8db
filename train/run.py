"""`python -m train.run --config train/configs/NAME.yaml [--resume] [key=value ...]`: offline
asynchronous RL on a dataset, through the same four loops as live traffic.

The command keeps the name users know; what it runs is a whole deployment (serve, collect,
judge, train and the rollout driver), so its code lives with the deployment, in
`deploy/offline_rl.py`. Nothing in the train loop imports it.
"""

from deploy.offline_rl import main

if __name__ == "__main__":
    raise SystemExit(main())
