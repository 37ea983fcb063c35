#include "apps/moeserve/rank_launch.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <fstream>
#include <iterator>
#include <thread>

#include <fmt/format.h>

#include "core/logging.h"

namespace moe::apps {

void add_parallel_options(CLI::App* cmd, ParallelArgs& a) {
  cmd->add_option("--tensor-parallel-size,--tp", a.tp, "Ranks splitting attention heads and dense MLPs (processes; on GPUs one per GPU)")
      ->check(CLI::Range(1, 64));
  cmd->add_option("--expert-parallel-size,--ep", a.ep, "Ranks splitting the experts (equal to --tp when both > 1)")
      ->check(CLI::Range(1, 64));
  cmd->add_option("--data-parallel-size,--dp", a.dp, "Data-parallel attention ranks (decode instances)")
      ->check(CLI::Range(1, 64));
  // Set by a leader on the ranks it starts; not for users.
  cmd->add_option("--internal-rank", a.internal_rank)->group("");
  cmd->add_option("--internal-group", a.internal_group)->group("");
  cmd->add_option("--internal-plan-fd", a.internal_plan_fd)->group("");
  cmd->add_option("--internal-num-pages", a.internal_num_pages)->group("");
  cmd->add_option("--internal-bootstrap-port", a.internal_bootstrap_port)->group("");
}

std::string new_group_name() {
  const auto now = std::chrono::steady_clock::now().time_since_epoch().count();
  return fmt::format("moeserve-{}-{:x}", getpid(), static_cast<uint64_t>(now));
}

void stop_when_leader_exits(int plan_fd, std::function<void()> before_stop) {
  std::thread([plan_fd, before_stop = std::move(before_stop)] {
    char byte;
    while (true) {
      const ssize_t r = ::read(plan_fd, &byte, 1);
      if (r == 0 || (r < 0 && errno != EINTR)) break;
    }
    log_info("the leader rank went away: stopping this rank");
    if (before_stop) before_stop();
    ::kill(::getpid(), SIGTERM);
  }).detach();
}

void exit_when_leader_exits(int plan_fd) {
  std::thread([plan_fd] {
    pollfd watch{plan_fd, POLLRDHUP, 0};  // the peer's close, without consuming any plan bytes
    while (true) {
      const int r = ::poll(&watch, 1, -1);
      if (r < 0 && errno == EINTR) continue;
      if (r < 0 || (watch.revents & (POLLRDHUP | POLLHUP | POLLERR)) != 0) break;
    }
    // A leader that stops in order sends "stop" before it closes: give this
    // rank's main thread the time to read it and exit cleanly first.
    std::this_thread::sleep_for(std::chrono::seconds(2));
    log_error("the leader rank went away: this rank exits");
    ::_exit(1);
  }).detach();
}

namespace {

// This process's own arguments, as it was started.
std::vector<std::string> own_arguments() {
  std::ifstream in("/proc/self/cmdline", std::ios::binary);
  const std::string all((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<std::string> out;
  for (size_t at = 0; at < all.size();) {
    const size_t end = all.find('\0', at);
    out.push_back(all.substr(at, end == std::string::npos ? std::string::npos : end - at));
    if (end == std::string::npos) break;
    at = end + 1;
  }
  return out;
}

}  // namespace

Followers::~Followers() {
  // The plan sockets are closed by then (the LeaderRunner owns them), or are
  // closed here if it never took them.
  for (int fd : fds) ::close(fd);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  for (pid_t pid : pids_) {
    int status = 0;
    while (::waitpid(pid, &status, WNOHANG) == 0) {
      if (std::chrono::steady_clock::now() > deadline) {
        log_warn("rank process {} did not stop; killing it", pid);
        ::kill(pid, SIGKILL);
        ::waitpid(pid, &status, 0);
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  }
}

Expected<Followers> spawn_followers(const ParallelArgs& args, const std::string& group, int32_t num_pages,
                                    int bootstrap_port) {
  const std::vector<std::string> base = own_arguments();
  if (base.empty()) return internal_error("cannot read /proc/self/cmdline to start the other ranks");
  Followers followers;
  for (int rank = 1; rank < args.world(); ++rank) {
    int pair[2];
    if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, pair) != 0)
      return internal_error("socketpair: {}", std::strerror(errno));
    std::vector<std::string> argv = base;
    for (std::string extra : {fmt::format("--internal-rank={}", rank), fmt::format("--internal-group={}", group),
                              fmt::format("--internal-plan-fd={}", pair[1]),
                              fmt::format("--internal-num-pages={}", num_pages)})
      argv.push_back(extra);
    if (bootstrap_port > 0) argv.push_back(fmt::format("--internal-bootstrap-port={}", bootstrap_port));
    std::vector<char*> c_argv;
    for (auto& a : argv) c_argv.push_back(a.data());
    c_argv.push_back(nullptr);
    const pid_t pid = ::fork();
    if (pid < 0) {
      ::close(pair[0]), ::close(pair[1]);
      return internal_error("fork: {}", std::strerror(errno));
    }
    if (pid == 0) {  // the child: only async-signal-safe calls until exec
      ::fcntl(pair[1], F_SETFD, 0);  // this end survives exec
      ::execv("/proc/self/exe", c_argv.data());
      ::_exit(127);
    }
    ::close(pair[1]);
    followers.fds.push_back(pair[0]);
    followers.pids_.push_back(pid);
    log_info("started rank {} of {} (pid {})", rank, args.world(), pid);
  }
  return followers;
}

}  // namespace moe::apps
