from bapo_megatron.commands.console import train

if __name__ == "__main__":
    train()
