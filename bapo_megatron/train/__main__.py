from bapo_megatron.trainer.main import main

if __name__ == "__main__":
    main()
