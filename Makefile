# Thin driver over CMake. `make` builds everything into build/ (the CLI is
# build/bin/moeserve); see README for the two set-up commands.
JOBS ?= $(shell nproc)
BUILD ?= build
CMAKE_FLAGS ?=

.PHONY: all test asan asan-test fuzz format clean

all:
	cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=Release $(CMAKE_FLAGS)
	cmake --build $(BUILD) -j $(JOBS)

test: all
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS) -LE gpu

# AddressSanitizer + UndefinedBehaviorSanitizer build of the CPU targets.
asan:
	cmake -S . -B build-asan -DCMAKE_BUILD_TYPE=Debug -DMOE_SANITIZE=ON $(CMAKE_FLAGS)
	cmake --build build-asan -j $(JOBS)

asan-test: asan
	cd build-asan && ctest --output-on-failure -j $(JOBS) -LE "gpu|slow"

# libFuzzer targets (clang).
fuzz:
	cmake -S . -B build-fuzz -DCMAKE_BUILD_TYPE=Debug -DMOE_FUZZ=ON -DMOE_CUDA=OFF \
	  -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_C_COMPILER=clang $(CMAKE_FLAGS)
	cmake --build build-fuzz -j $(JOBS) --target safetensors_fuzz tokenizer_fuzz chat_template_fuzz structured_fuzz

format:
	clang-format -i $$(git ls-files '*.h' '*.cc' '*.cu' '*.cuh')

clean:
	rm -rf build build-asan build-fuzz
