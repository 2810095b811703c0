// dsv4_run: runs a dsv4 .pt2 package without Python.
//
//   dsv4_run [--ops-lib PATH] [--max-new-tokens N] [--metadata] PACKAGE.pt2 ID [ID ...]
//
// Loads the op library (--ops-lib, else $DSV4_OPS_LIBRARY) with RTLD_GLOBAL BEFORE the package: the package
// calls dsv4:: ops through the dispatcher, so their schemas must be registered first. Reads the package's
// dsv4 metadata (entries, cache shapes), allocates the caches, runs prefill on the prompt ids (smallest
// prefill bucket that holds them, right-padded, with lengths; a longer prompt in chunks through a prefill_chunk
// entry), then greedy decode (smallest decode bucket), and
// prints "generated: id id ..." on stdout. --metadata prints the decode entry's AOTI metadata.
// Every failure is one line on stderr and exit code 2; a completion cut short by the package's max_seq_len
// says so on stderr (as `python -m dsv4_export run` does) and exits 0. Before loading an entry it checks what
// Python's loader checks of the metadata (format, exact torch version, a CUDA device for a CUDA package) and the
// CRC-32 of the members it loads (a damaged package is refused instead of running garbage kernels).
#include <dlfcn.h>

#include <sys/stat.h>

#include <array>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <algorithm>
#include <map>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <caffe2/serialize/inline_container.h>
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>
#include <torch/cuda.h>

#if __has_include(<torch/headeronly/version.h>)
#include <torch/headeronly/version.h>
#elif __has_include(<torch/version.h>)
#include <torch/version.h>
#endif

namespace {

// Must match dsv4_export/metadata.py FORMAT_VERSION.
constexpr const char* kFormatVersion = "1";

[[noreturn]] void fail(const std::string& msg) {
  std::cerr << "dsv4_run: error: " << msg << std::endl;
  std::exit(2);
}

// torch's messages run on for lines (hints, "Exception raised from", frames): the first line is the message.
std::string first_line(const std::string& s) { return s.substr(0, s.find('\n')); }

// --- the package as a zip: members and their CRC-32 (libtorch's zip reader skips the CRC check) ---------------
struct Member {
  std::string name;
  uint32_t crc = 0;
  uint16_t method = 0;
  uint64_t size = 0;          // compressed = stored size
  uint64_t local_offset = 0;  // of its local header
};

uint64_t le(const unsigned char* p, int n) {
  uint64_t v = 0;
  for (int i = n - 1; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

// The central directory (zip64 included: packages with large .so files use it); empty if there is none.
std::vector<Member> zip_members(std::ifstream& f) {
  f.seekg(0, std::ios::end);
  const uint64_t file_size = static_cast<uint64_t>(f.tellg());
  const uint64_t tail_len = std::min<uint64_t>(file_size, 65536 + 22);
  std::vector<unsigned char> tail(tail_len);
  f.seekg(static_cast<std::streamoff>(file_size - tail_len));
  f.read(reinterpret_cast<char*>(tail.data()), static_cast<std::streamsize>(tail_len));
  if (!f || tail_len < 22) return {};
  int64_t eocd = -1;
  for (int64_t i = static_cast<int64_t>(tail_len) - 22; i >= 0; --i) {
    if (le(&tail[i], 4) == 0x06054b50) {
      eocd = i;
      break;
    }
  }
  if (eocd < 0) return {};
  uint64_t count = le(&tail[eocd + 10], 2), cd_size = le(&tail[eocd + 12], 4), cd_offset = le(&tail[eocd + 16], 4);
  if ((count == 0xffff || cd_size == 0xffffffff || cd_offset == 0xffffffff) && eocd >= 20 &&
      le(&tail[eocd - 20], 4) == 0x07064b50) {
    unsigned char z64[56];
    f.seekg(static_cast<std::streamoff>(le(&tail[eocd - 20 + 8], 8)));
    f.read(reinterpret_cast<char*>(z64), sizeof z64);
    if (!f || le(z64, 4) != 0x06064b50) return {};
    count = le(z64 + 32, 8), cd_size = le(z64 + 40, 8), cd_offset = le(z64 + 48, 8);
  }
  if (cd_offset + cd_size > file_size) return {};
  std::vector<unsigned char> cd(cd_size);
  f.seekg(static_cast<std::streamoff>(cd_offset));
  f.read(reinterpret_cast<char*>(cd.data()), static_cast<std::streamsize>(cd_size));
  if (!f) return {};
  std::vector<Member> out;
  for (uint64_t p = 0, i = 0; i < count; ++i) {
    if (p + 46 > cd_size || le(&cd[p], 4) != 0x02014b50) return {};
    Member m;
    m.method = static_cast<uint16_t>(le(&cd[p + 10], 2));
    m.crc = static_cast<uint32_t>(le(&cd[p + 16], 4));
    m.size = le(&cd[p + 20], 4);
    uint64_t usize = le(&cd[p + 24], 4);
    const uint64_t name_len = le(&cd[p + 28], 2), extra_len = le(&cd[p + 30], 2), comment_len = le(&cd[p + 32], 2);
    m.local_offset = le(&cd[p + 42], 4);
    if (p + 46 + name_len + extra_len > cd_size) return {};
    m.name.assign(reinterpret_cast<const char*>(&cd[p + 46]), name_len);
    // zip64 extra field: the 8-byte values of the fields that say 0xffffffff, in this order
    for (uint64_t e = p + 46 + name_len, end = e + extra_len; e + 4 <= end;) {
      const uint64_t id = le(&cd[e], 2), len = le(&cd[e + 2], 2);
      if (id == 1) {
        uint64_t q = e + 4;
        if (usize == 0xffffffff && q + 8 <= e + 4 + len) usize = le(&cd[q], 8), q += 8;
        if (m.size == 0xffffffff && q + 8 <= e + 4 + len) m.size = le(&cd[q], 8), q += 8;
        if (m.local_offset == 0xffffffff && q + 8 <= e + 4 + len) m.local_offset = le(&cd[q], 8);
      }
      e += 4 + len;
    }
    out.push_back(m);
    p += 46 + name_len + extra_len + comment_len;
  }
  return out;
}

// zip's CRC-32, eight bytes per step ("slicing-by-8": ~0.5 s per GB, the byte-wise table's is ~2.4).
uint32_t crc32(uint32_t crc, const unsigned char* p, size_t n) {
  static const auto t = [] {
    std::array<std::array<uint32_t, 256>, 8> t{};
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? 0xedb88320u ^ (c >> 1) : c >> 1;
      t[0][i] = c;
    }
    for (int s = 1; s < 8; ++s) {
      for (int i = 0; i < 256; ++i) t[s][i] = (t[s - 1][i] >> 8) ^ t[0][t[s - 1][i] & 0xff];
    }
    return t;
  }();
  crc = ~crc;
  for (; n >= 8; p += 8, n -= 8) {
    const uint32_t lo = crc ^ static_cast<uint32_t>(le(p, 4)), hi = static_cast<uint32_t>(le(p + 4, 4));
    crc = t[7][lo & 0xff] ^ t[6][(lo >> 8) & 0xff] ^ t[5][(lo >> 16) & 0xff] ^ t[4][lo >> 24] ^ t[3][hi & 0xff] ^
          t[2][(hi >> 8) & 0xff] ^ t[1][(hi >> 16) & 0xff] ^ t[0][hi >> 24];
  }
  while (n--) crc = t[0][(crc ^ *p++) & 0xff] ^ (crc >> 8);
  return ~crc;
}

// Fails unless `pkg` is a zip whose stored members under .../aotinductor/<entry>/ (for the entries given) and
// .../extra/ have their recorded CRC-32.
void check_archive(const std::string& pkg, const std::vector<std::string>& entries) {
  std::ifstream f(pkg, std::ios::binary);
  if (!f) fail(pkg + ": cannot open it");
  const std::vector<Member> members = zip_members(f);
  if (members.empty()) fail(pkg + ": not a readable .pt2 package (no zip central directory: cut short, or no zip)");
  std::vector<unsigned char> buf(1 << 20);
  for (const auto& m : members) {
    bool wanted = m.name.find("/extra/") != std::string::npos;
    for (const auto& e : entries) wanted = wanted || m.name.find("/aotinductor/" + e + "/") != std::string::npos;
    if (!wanted || m.method != 0) continue;  // torch writes its archives uncompressed
    unsigned char local[30];
    f.clear();
    f.seekg(static_cast<std::streamoff>(m.local_offset));
    f.read(reinterpret_cast<char*>(local), sizeof local);
    if (!f || le(local, 4) != 0x04034b50) fail(pkg + ": damaged package (no local header for " + m.name + ")");
    f.seekg(static_cast<std::streamoff>(m.local_offset + 30 + le(local + 26, 2) + le(local + 28, 2)));
    uint32_t crc = 0;
    for (uint64_t left = m.size; left > 0;) {
      const size_t n = static_cast<size_t>(std::min<uint64_t>(left, buf.size()));
      f.read(reinterpret_cast<char*>(buf.data()), static_cast<std::streamsize>(n));
      if (!f) fail(pkg + ": damaged package (" + m.name + " is cut short)");
      crc = crc32(crc, buf.data(), n);
      left -= n;
    }
    if (crc != m.crc) {
      fail(pkg + ": damaged package (Bad CRC-32 for file '" + m.name + "'): copy it again or rebuild it");
    }
  }
}

// A whole decimal integer (no trailing characters, in range), else fail() naming `what`.
int64_t parse_int(const std::string& s, const std::string& what) {
  errno = 0;
  char* end = nullptr;
  const long long v = std::strtoll(s.c_str(), &end, 10);
  if (s.empty() || end != s.c_str() + s.size() || errno == ERANGE) fail(what + " must be an integer, got '" + s + "'");
  return v;
}

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, sep)) {
    if (!item.empty()) out.push_back(item);
  }
  return out;
}

// The package's extra/dsv4_metadata.json is a flat JSON object of string values; the runner only needs a
// few keys whose values contain no quotes or escapes, so a string search is enough (no JSON library).
std::string json_string_value(const std::string& json, const std::string& key) {
  const std::string needle = "\"" + key + "\"";
  size_t k = json.find(needle);
  if (k == std::string::npos) fail("package metadata has no key " + key + " (not a dsv4 package?)");
  size_t colon = json.find(':', k + needle.size());
  size_t open = json.find('"', colon + 1);
  size_t close = json.find('"', open + 1);
  if (colon == std::string::npos || open == std::string::npos || close == std::string::npos) {
    fail("malformed package metadata at key " + key);
  }
  return json.substr(open + 1, close - open - 1);
}

std::string read_package_metadata(const std::string& pkg) {
  const std::string record = "extra/dsv4_metadata.json";
  try {
    caffe2::serialize::PyTorchStreamReader reader(pkg);
    if (!reader.hasRecord(record)) fail(pkg + " has no " + record + ": build it with `python -m dsv4_export build`");
    auto [data, size] = reader.getRecord(record);
    return std::string(static_cast<const char*>(data.get()), size);
  } catch (const c10::Error& e) {  // miniz's sentence, without its paragraph of advice
    const std::string msg = first_line(e.what_without_backtrace());
    fail(pkg + ": not a readable .pt2 package (" + msg.substr(0, msg.find(". ")) + ")");
  }
}

c10::ScalarType parse_dtype(const std::string& s) {
  static const std::map<std::string, c10::ScalarType> table = {
      {"float32", at::kFloat},         {"float16", at::kHalf},    {"bfloat16", at::kBFloat16},
      {"float64", at::kDouble},        {"int64", at::kLong},      {"int32", at::kInt},
      {"int16", at::kShort},           {"int8", at::kChar},       {"uint8", at::kByte},
      {"bool", at::kBool},             {"float8_e4m3fn", at::kFloat8_e4m3fn},
      {"float8_e5m2", at::kFloat8_e5m2}};
  auto it = table.find(s);
  if (it == table.end()) fail("unsupported cache dtype " + s);
  return it->second;
}

struct Bucket {
  int64_t batch = -1;
  int64_t seq_len = 0;  // prefill only
  std::string name;
};

// Entry names: decode_b<B>, prefill_b<B>_s<S>, prefill_chunk_b<B>_s<C>. Picks the smallest entry holding 1 row
// of `tokens` tokens (batch -1 if none: `required` fails instead).
Bucket pick(const std::string& csv, const std::string& kind, int64_t tokens, bool required = true) {
  Bucket best;
  for (const auto& name : split(csv, ',')) {
    Bucket e;
    e.name = name;
    size_t b = name.find("_b"), s = name.find("_s", b == std::string::npos ? 0 : b);
    if (b == std::string::npos) fail("unexpected entry name " + name);
    e.batch = parse_int(name.substr(b + 2, s == std::string::npos ? std::string::npos : s - b - 2), "entry " + name);
    e.seq_len = s == std::string::npos ? 1 : parse_int(name.substr(s + 2), "entry " + name);
    if (e.seq_len < tokens) continue;
    if (best.batch < 0 || e.batch * e.seq_len < best.batch * best.seq_len) best = e;
  }
  if (best.batch < 0 && required) fail("package has no " + kind + " entry for " + std::to_string(tokens) + " tokens");
  return best;
}

}  // namespace

std::string g_pkg;  // named in the errors torch raises while the package loads and runs

int run(int argc, char** argv) {
  std::string ops_lib = std::getenv("DSV4_OPS_LIBRARY") ? std::getenv("DSV4_OPS_LIBRARY") : "";
  int64_t max_new_tokens = 8;
  bool print_metadata = false;
  std::string pkg;
  std::vector<int64_t> prompt;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--ops-lib" || a == "--max-new-tokens") {
      if (i + 1 >= argc) fail(a + " needs a value (--help)");
      if (a == "--ops-lib") {
        ops_lib = argv[++i];
      } else {
        max_new_tokens = parse_int(argv[++i], "--max-new-tokens");
        if (max_new_tokens < 1) fail("--max-new-tokens must be >= 1, got " + std::to_string(max_new_tokens));
      }
    } else if (a == "--metadata") {
      print_metadata = true;
    } else if (a == "-h" || a == "--help") {
      std::cout << "usage: dsv4_run [--ops-lib PATH] [--max-new-tokens N] [--metadata] PACKAGE.pt2 ID [ID ...]\n";
      return 0;
    } else if (a.rfind("--", 0) == 0) {
      fail("unknown option " + a + " (--help)");
    } else if (pkg.empty()) {
      pkg = a;
    } else {
      prompt.push_back(parse_int(a, "prompt id"));
    }
  }
  if (pkg.empty() || (prompt.empty() && !print_metadata)) fail("need a package and at least one prompt id (--help)");
  g_pkg = pkg;
  struct stat st {};
  if (stat(pkg.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) fail("no package at " + pkg);
  if (ops_lib.empty()) fail("no op library: pass --ops-lib PATH/libdsv4_ops.so or set DSV4_OPS_LIBRARY");
  // RTLD_GLOBAL: the library's static initializers register torch.ops.dsv4.* in this process's dispatcher.
  if (!dlopen(ops_lib.c_str(), RTLD_NOW | RTLD_GLOBAL)) fail(std::string("cannot load op library: ") + dlerror());

  const std::string meta_json = read_package_metadata(pkg);
  // The checks (and words) of dsv4_export/metadata.py check(), in its order.
  const std::string format = json_string_value(meta_json, "dsv4.format");
  if (format != kFormatVersion) {
    fail("package format '" + format + "', this loader reads '" + kFormatVersion + "': rebuild it");
  }
  const std::string built_torch = json_string_value(meta_json, "dsv4.torch_version");
#if defined(DSV4_TORCH_VERSION)
  const std::string here_torch = DSV4_TORCH_VERSION;  // torch.__version__ of the torch build.sh linked (exact)
  const bool same_torch = built_torch == here_torch;
#else  // configured by hand: the header knows major.minor.patch, not the local part (+cpu, +cu128)
  const std::string here_torch = TORCH_VERSION;
  const bool same_torch = built_torch == here_torch || built_torch.rfind(here_torch + "+", 0) == 0;
#endif
  if (!same_torch) {
    fail("package built with torch " + built_torch + ", this runner links torch " + here_torch +
         ": AOTInductor packages are tied to the torch build that compiled them; rebuild it here (or the runner "
         "against that torch)");
  }
  const std::string device_name = json_string_value(meta_json, "dsv4.device");
  if (device_name != "cpu" && device_name != "cuda") fail("package built for unknown device '" + device_name + "'");
  const at::Device device(device_name);
  if (device.is_cuda()) {
    // The CUDA runtime pieces (AOTI's CUDA model runner, CUDA hooks) register from libtorch_cuda's static
    // initializers: make sure it is loaded even if the linker dropped it as unneeded.
    dlopen("libtorch_cuda.so", RTLD_NOW | RTLD_GLOBAL);
    if (!torch::cuda::is_available()) fail("package built for CUDA, but this process sees no CUDA device");
  }
  const int64_t vocab = parse_int(json_string_value(meta_json, "dsv4.vocab_size"), "dsv4.vocab_size");
  for (int64_t id : prompt) {
    if (id < 0 || id >= vocab) {
      fail("prompt id " + std::to_string(id) + " outside [0, vocab_size=" + std::to_string(vocab) + ")");
    }
  }
  const int64_t t = static_cast<int64_t>(prompt.size());
  const int64_t max_seq = parse_int(json_string_value(meta_json, "dsv4.max_seq_len"), "dsv4.max_seq_len");
  if (!print_metadata && t > max_seq) {
    fail("prompt of " + std::to_string(t) + " ids exceeds the package's max_seq_len " + std::to_string(max_seq));
  }
  const Bucket decode = pick(json_string_value(meta_json, "dsv4.cpp.decode_entries"), "decode", 1);
  if (print_metadata) {
    check_archive(pkg, {decode.name});
    torch::inductor::AOTIModelPackageLoader decode_model(pkg, decode.name);
    for (const auto& [k, v] : decode_model.get_metadata()) std::cout << k << "=" << v << "\n";
    return 0;
  }
  // The smallest prefill bucket holding the prompt, else chunks through the prefill_chunk entry (the longest).
  const std::string chunk_key = "dsv4.cpp.prefill_chunk_entries";  // absent in packages built before it
  const std::string chunk_csv =
      meta_json.find("\"" + chunk_key + "\"") == std::string::npos ? "" : json_string_value(meta_json, chunk_key);
  Bucket prefill = pick(json_string_value(meta_json, "dsv4.cpp.prefill_entries"), "prefill", t, chunk_csv.empty());
  const bool chunked = prefill.batch < 0;
  if (chunked) {
    for (const auto& name : split(chunk_csv, ',')) {
      Bucket e = pick(name, "prefill_chunk", 1);
      if (prefill.batch < 0 || e.seq_len > prefill.seq_len) prefill = e;
    }
  }
  check_archive(pkg, {decode.name, prefill.name});
  torch::inductor::AOTIModelPackageLoader decode_model(pkg, decode.name);
  torch::inductor::AOTIModelPackageLoader prefill_model(pkg, prefill.name);
  // Every token after the first is one decode step at the next position: at most max_seq - t + 1 tokens.
  const int64_t n_new = std::min(max_new_tokens, max_seq - t + 1);

  std::vector<at::Tensor> caches;
  for (const auto& spec : split(json_string_value(meta_json, "dsv4.cpp.caches"), ';')) {
    auto parts = split(spec, ':');  // name:dtype:d0xd1x...
    if (parts.size() != 3) fail("malformed cache spec " + spec);
    std::vector<int64_t> shape;
    for (const auto& d : split(parts[2], 'x')) shape.push_back(parse_int(d, "cache spec " + spec));
    caches.push_back(at::zeros(shape, at::TensorOptions().dtype(parse_dtype(parts[1])).device(device)));
  }
  auto with_caches = [&](std::vector<at::Tensor> inputs) {
    inputs.insert(inputs.end(), caches.begin(), caches.end());
    return inputs;
  };
  auto opts = at::TensorOptions().dtype(at::kLong).device(device);

  // Prefill the prompt into cache row 0, right-padded to the bucket length; rows 1.. of a larger bucket
  // get one token 0 and are never read. Chunked: C positions at a time from start c0 (row 0's last chunk
  // padded; rows 1.. have no tokens), the logits of the chunk holding the last token.
  const at::Tensor ids = at::tensor(prompt, at::kLong);
  at::Tensor logits;
  for (int64_t c0 = 0; c0 < t; c0 += prefill.seq_len) {
    const int64_t n = std::min(prefill.seq_len, t - c0);
    at::Tensor tokens = at::zeros({prefill.batch, prefill.seq_len}, opts);
    tokens[0].narrow(0, 0, n).copy_(ids.narrow(0, c0, n));
    at::Tensor lengths = chunked ? at::zeros({prefill.batch}, opts) : at::ones({prefill.batch}, opts);
    lengths[0].fill_(n);
    logits = chunked ? prefill_model.run(with_caches({tokens, lengths, at::full({prefill.batch}, c0, opts)}))[0]
                     : prefill_model.run(with_caches({tokens, lengths}))[0];
  }

  std::vector<int64_t> generated;
  int64_t pos = t;
  for (int64_t i = 0; i < n_new; ++i) {
    const int64_t next = logits[0].argmax().item<int64_t>();
    generated.push_back(next);
    if (i + 1 == n_new) break;
    at::Tensor tok = at::zeros({decode.batch}, opts);
    at::Tensor positions = at::zeros({decode.batch}, opts);
    tok[0].fill_(next);
    positions[0].fill_(pos++);
    logits = decode_model.run(with_caches({tok, positions}))[0];
  }
  std::cout << "generated:";
  for (int64_t id : generated) std::cout << " " << id;
  std::cout << std::endl;
  if (n_new < max_new_tokens) {
    std::cerr << "dsv4_run: cut short after " << n_new << " of " << max_new_tokens
              << " tokens: the package's caches hold max_seq_len=" << max_seq << " positions" << std::endl;
  }
  return 0;
}

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const c10::Error& e) {
    fail((g_pkg.empty() ? "" : g_pkg + ": ") + first_line(e.what_without_backtrace()));
  } catch (const std::exception& e) {
    fail((g_pkg.empty() ? "" : g_pkg + ": ") + first_line(e.what()));
  }
}
