/* A Vulkan layer that writes every SPIR-V module an application creates to
 * $MN_SPIRV_DUMP/<n>.spv (n = 0, 1, ... in creation order), then passes the call on.
 *
 * Why: Dawn compiles our WGSL to SPIR-V inside the process and gives it straight to the driver;
 * bench/pipeline_stats.py needs that exact SPIR-V to ask the driver (through
 * VK_KHR_pipeline_executable_properties) how many registers and how much local memory each of
 * our kernels gets.  Build: bench/pipeline_stats.py --build-layer (gcc, Vulkan headers). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <vulkan/vk_layer.h>
#include <vulkan/vulkan.h>

#define EXPORT __attribute__((visibility("default")))

static PFN_vkGetInstanceProcAddr next_gipa;
static PFN_vkGetDeviceProcAddr next_gdpa;
static int counter;

static VkResult VKAPI_CALL dump_CreateShaderModule(VkDevice device,
                                                   const VkShaderModuleCreateInfo *info,
                                                   const VkAllocationCallbacks *alloc,
                                                   VkShaderModule *module) {
  const char *dir = getenv("MN_SPIRV_DUMP");
  if (dir && info && info->pCode) {
    char path[4096];
    snprintf(path, sizeof path, "%s/%05d.spv", dir, counter++);
    FILE *f = fopen(path, "wb");
    if (f) {
      fwrite(info->pCode, 1, info->codeSize, f);
      fclose(f);
    }
  }
  PFN_vkCreateShaderModule next =
      (PFN_vkCreateShaderModule)next_gdpa(device, "vkCreateShaderModule");
  return next(device, info, alloc, module);
}

static VkResult VKAPI_CALL dump_CreateInstance(const VkInstanceCreateInfo *info,
                                               const VkAllocationCallbacks *alloc,
                                               VkInstance *instance) {
  VkLayerInstanceCreateInfo *link = (VkLayerInstanceCreateInfo *)info->pNext;
  while (link && !(link->sType == VK_STRUCTURE_TYPE_LOADER_INSTANCE_CREATE_INFO &&
                   link->function == VK_LAYER_LINK_INFO))
    link = (VkLayerInstanceCreateInfo *)link->pNext;
  if (!link) return VK_ERROR_INITIALIZATION_FAILED;
  next_gipa = link->u.pLayerInfo->pfnNextGetInstanceProcAddr;
  link->u.pLayerInfo = link->u.pLayerInfo->pNext;
  PFN_vkCreateInstance next = (PFN_vkCreateInstance)next_gipa(NULL, "vkCreateInstance");
  return next(info, alloc, instance);
}

static VkResult VKAPI_CALL dump_CreateDevice(VkPhysicalDevice physical,
                                             const VkDeviceCreateInfo *info,
                                             const VkAllocationCallbacks *alloc,
                                             VkDevice *device) {
  VkLayerDeviceCreateInfo *link = (VkLayerDeviceCreateInfo *)info->pNext;
  while (link && !(link->sType == VK_STRUCTURE_TYPE_LOADER_DEVICE_CREATE_INFO &&
                   link->function == VK_LAYER_LINK_INFO))
    link = (VkLayerDeviceCreateInfo *)link->pNext;
  if (!link) return VK_ERROR_INITIALIZATION_FAILED;
  PFN_vkGetInstanceProcAddr gipa = link->u.pLayerInfo->pfnNextGetInstanceProcAddr;
  next_gdpa = link->u.pLayerInfo->pfnNextGetDeviceProcAddr;
  link->u.pLayerInfo = link->u.pLayerInfo->pNext;
  PFN_vkCreateDevice next = (PFN_vkCreateDevice)gipa(NULL, "vkCreateDevice");
  return next(physical, info, alloc, device);
}

EXPORT VKAPI_ATTR PFN_vkVoidFunction VKAPI_CALL vkGetDeviceProcAddr(VkDevice device,
                                                                    const char *name) {
  if (!strcmp(name, "vkCreateShaderModule")) return (PFN_vkVoidFunction)dump_CreateShaderModule;
  if (!strcmp(name, "vkGetDeviceProcAddr")) return (PFN_vkVoidFunction)vkGetDeviceProcAddr;
  return next_gdpa(device, name);
}

EXPORT VKAPI_ATTR PFN_vkVoidFunction VKAPI_CALL vkGetInstanceProcAddr(VkInstance instance,
                                                                      const char *name) {
  if (!strcmp(name, "vkCreateInstance")) return (PFN_vkVoidFunction)dump_CreateInstance;
  if (!strcmp(name, "vkCreateDevice")) return (PFN_vkVoidFunction)dump_CreateDevice;
  if (!strcmp(name, "vkGetInstanceProcAddr")) return (PFN_vkVoidFunction)vkGetInstanceProcAddr;
  if (!strcmp(name, "vkGetDeviceProcAddr")) return (PFN_vkVoidFunction)vkGetDeviceProcAddr;
  if (!strcmp(name, "vkCreateShaderModule")) return (PFN_vkVoidFunction)dump_CreateShaderModule;
  return next_gipa(instance, name);
}
