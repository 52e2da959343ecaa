from bapo_megatron.trainer.main import main

main()
