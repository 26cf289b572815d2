// A minimal reader for NumPy .npy files (format 1.0, little endian, C order) holding float32 or
// int32 arrays, enough for the golden cases.
#pragma once

#include <cstdint>
#include <cstring>
#include <fstream>
#include <iterator>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

namespace flash_msa::test {

template <class T>
struct NpyArray {
  std::vector<int64_t> shape;
  std::vector<T> data;
};

namespace npy_detail {

inline std::string header_value(const std::string& header, const std::string& key) {
  const size_t at = header.find("'" + key + "'");
  if (at == std::string::npos) throw std::runtime_error("npy: header has no " + key);
  const size_t colon = header.find(':', at);
  size_t begin = header.find_first_not_of(' ', colon + 1);
  size_t end;
  if (header[begin] == '(') {
    end = header.find(')', begin) + 1;
  } else if (header[begin] == '\'') {
    end = header.find('\'', begin + 1) + 1;
  } else {
    end = header.find_first_of(",}", begin);
  }
  return header.substr(begin, end - begin);
}

inline std::vector<int64_t> parse_shape(const std::string& tuple) {
  std::vector<int64_t> shape;
  for (size_t i = 1; i < tuple.size();) {
    const size_t digit = tuple.find_first_of("0123456789", i);
    if (digit == std::string::npos) break;
    size_t used = 0;
    shape.push_back(std::stoll(tuple.substr(digit), &used));
    i = digit + used;
  }
  return shape;
}

template <class T>
constexpr const char* descr() {
  return std::is_same_v<T, float> ? "'<f4'" : "'<i4'";
}

}  // namespace npy_detail

// Reads `path`; throws std::runtime_error if it is not a v1.0 C-order array of T (float, int32_t).
template <class T>
NpyArray<T> read_npy(const std::string& path) {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, int32_t>);
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("npy: cannot open " + path);
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (bytes.size() < 10 || bytes.compare(0, 6, "\x93NUMPY") != 0 || bytes[6] != 1)
    throw std::runtime_error("npy: not a version 1.0 file: " + path);
  const size_t header_len = static_cast<unsigned char>(bytes[8]) |
                            (static_cast<size_t>(static_cast<unsigned char>(bytes[9])) << 8);
  const std::string header = bytes.substr(10, header_len);
  if (npy_detail::header_value(header, "descr") != npy_detail::descr<T>())
    throw std::runtime_error("npy: " + path + ": dtype " +
                             npy_detail::header_value(header, "descr"));
  if (npy_detail::header_value(header, "fortran_order") != "False")
    throw std::runtime_error("npy: " + path + ": Fortran order");
  NpyArray<T> a;
  a.shape = npy_detail::parse_shape(npy_detail::header_value(header, "shape"));
  size_t count = 1;
  for (int64_t n : a.shape) count *= static_cast<size_t>(n);
  const size_t data_at = 10 + header_len;
  if (bytes.size() != data_at + count * sizeof(T))
    throw std::runtime_error("npy: " + path + ": size does not match the shape");
  a.data.resize(count);
  std::memcpy(a.data.data(), bytes.data() + data_at, count * sizeof(T));
  return a;
}

}  // namespace flash_msa::test
