from bapo_megatron.train.process_exit import skip_final_collection
from bapo_megatron.trainer.main import main

if __name__ == "__main__":
    main()
    skip_final_collection()
