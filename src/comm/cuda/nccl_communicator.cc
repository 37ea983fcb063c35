// NCCL through dlopen: see nccl_communicator.h. nccl.h is included for its
// types and signatures only.
#include "comm/cuda/nccl_communicator.h"

#include <dlfcn.h>
#include <nccl.h>

#include <cstring>

namespace moe::comm::cuda {
namespace {

struct NcclApi {
  decltype(&ncclGetVersion) get_version = nullptr;
  decltype(&ncclGetUniqueId) get_unique_id = nullptr;
  decltype(&ncclCommInitRank) comm_init_rank = nullptr;
  decltype(&ncclAllReduce) all_reduce = nullptr;
  decltype(&ncclCommDestroy) comm_destroy = nullptr;
  decltype(&ncclGetErrorString) get_error_string = nullptr;
};

struct Loaded {
  NcclApi api;
  std::string error;
};

template <typename Fn>
void bind(void* library, const char* name, Fn& fn, std::string& error) {
  fn = reinterpret_cast<Fn>(dlsym(library, name));
  if (fn == nullptr && error.empty()) error = fmt::format("libnccl has no {}", name);
}

Loaded load() {
  Loaded l;
  void* library = dlopen("libnccl.so.2", RTLD_NOW | RTLD_LOCAL);
  if (library == nullptr) library = dlopen("libnccl.so", RTLD_NOW | RTLD_LOCAL);
  if (library == nullptr) {
    const char* why = dlerror();
    l.error = fmt::format("cannot load libnccl.so.2: {}", why == nullptr ? "not found" : why);
    return l;
  }
  bind(library, "ncclGetVersion", l.api.get_version, l.error);
  bind(library, "ncclGetUniqueId", l.api.get_unique_id, l.error);
  bind(library, "ncclCommInitRank", l.api.comm_init_rank, l.error);
  bind(library, "ncclAllReduce", l.api.all_reduce, l.error);
  bind(library, "ncclCommDestroy", l.api.comm_destroy, l.error);
  bind(library, "ncclGetErrorString", l.api.get_error_string, l.error);
  return l;  // the library stays loaded for the process's life
}

Expected<const NcclApi*> nccl() {
  static const Loaded loaded = load();
  if (!loaded.error.empty()) return unavailable("NCCL: {}", loaded.error);
  return &loaded.api;
}

Status nccl_status(const NcclApi& api, ncclResult_t result, const char* what) {
  if (result == ncclSuccess) return Status::ok();
  return internal_error("{}: {}", what, api.get_error_string(result));
}

}  // namespace

Expected<std::string> NcclCommunicator::library_version() {
  MOE_ASSIGN_OR_RETURN(const NcclApi* api, nccl());
  int version = 0;
  MOE_RETURN_IF_ERROR(nccl_status(*api, api->get_version(&version), "ncclGetVersion"));
  return fmt::format("{}.{}.{}", version / 10000, version / 100 % 100, version % 100);
}

Expected<std::unique_ptr<NcclCommunicator>> NcclCommunicator::create(TcpBootstrap& bootstrap, int device) {
  // Every rank learns whether NCCL loads everywhere before anyone blocks in init.
  auto api = nccl();
  const uint8_t ok = api.has_value();
  MOE_ASSIGN_OR_RETURN(auto all, bootstrap.all_gather({&ok, 1}));
  for (int r = 0; r < bootstrap.world_size(); ++r)
    if (all[r].size() != 1 || all[r][0] == 0)
      return api.has_value() ? unavailable("NCCL: rank {} cannot load libnccl", r) : api.status();
  ncclUniqueId id{};
  if (bootstrap.rank() == 0) MOE_RETURN_IF_ERROR(nccl_status(**api, (*api)->get_unique_id(&id), "ncclGetUniqueId"));
  MOE_ASSIGN_OR_RETURN(auto bytes, bootstrap.broadcast_from_root({reinterpret_cast<const uint8_t*>(&id), sizeof id}));
  if (bytes.size() != sizeof id) return data_loss("NCCL: a unique id of {} bytes", bytes.size());
  std::memcpy(&id, bytes.data(), sizeof id);
  if (cudaSetDevice(device) != cudaSuccess) return unavailable("NCCL: cannot use CUDA device {}", device);
  std::unique_ptr<NcclCommunicator> comm(new NcclCommunicator());
  ncclComm_t handle = nullptr;
  MOE_RETURN_IF_ERROR(nccl_status(**api, (*api)->comm_init_rank(&handle, bootstrap.world_size(), id, bootstrap.rank()),
                                  "ncclCommInitRank"));
  comm->comm_ = handle;
  return comm;
}

NcclCommunicator::~NcclCommunicator() {
  if (comm_ == nullptr) return;
  if (auto api = nccl(); api.has_value()) (*api)->comm_destroy(static_cast<ncclComm_t>(comm_));
}

Status NcclCommunicator::all_reduce(const __nv_bfloat16* input, __nv_bfloat16* output, int64_t n,
                                    cudaStream_t stream) {
  MOE_ASSIGN_OR_RETURN(const NcclApi* api, nccl());
  return nccl_status(*api,
                     api->all_reduce(input, output, static_cast<size_t>(n), ncclBfloat16, ncclSum,
                                     static_cast<ncclComm_t>(comm_), stream),
                     "ncclAllReduce");
}

}  // namespace moe::comm::cuda
