"""The train loop: decoupled PPO on scored samples, publishing new weight versions."""
