"""`python -m jax_fp4`: print the environment report (`jax_fp4.env_report`)."""

from jax_fp4.env import format_env_report

if __name__ == "__main__":
    print(format_env_report())
